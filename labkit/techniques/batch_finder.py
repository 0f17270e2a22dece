"""The OOM frontier: the largest micro-batch that fits a memory budget, probed, beside the planner.

The largest micro-batch (or sequence length) that a combination of techniques fits in memory,
found by probing, beside the planner's napkin answer.

Variants name the combination (precision x checkpointing): `fp32` (the reference), `fp32_ckpt`
(every block recomputed in backward), `bf16` (autocast), `bf16_ckpt`. With `effective_batch`,
accumulation keeps the sequences per optimizer step: the smaller the micro-batch that fits, the
more micro-batches per step.

The search runs in `check()`, inside the harness's memory meter: on the CPU the virtual budget's
tracker raises `torch.OutOfMemoryError` exactly where a GPU would, and on a GPU real memory does.
- `grow`: double from 1 while it fits, then bisect between the last fit and the first OOM.
- `dynamic`: start where the free memory at run time says (the planner's peak against it), then
  step up by 1, 2, 4, ... or bisect down (both `find_largest`, `labkit.blocks.search`).
Each probe is a fresh model, optimizer and batch running two training steps (the second with
AdamW's state resident); after an OOM every reference is dropped, so memory is back where it was.
The step the harness then measures and times is a training step at the size found.
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch

from labkit import hardware
from labkit.config import RunConfig, knob, resolve_device
from labkit.measure.memory import fits_in_memory
from labkit.blocks.recipe import Recipe, compose, planned_memory
from labkit.blocks.search import Search, find_largest
from labkit.blocks.training import Trainer
from labkit.blocks.transforms import apply_accumulation
from labkit.workload import Comparison, Workload

VARIANTS = ("fp32", "fp32_ckpt", "bf16", "bf16_ckpt")
REFERENCE = "fp32"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"memory_budget_gib": 0.1}, {"memory_budget_gib": 0.06, "seq_len": 32})

# on the CPU it searches a virtual budget (there is nothing else to run out of)
SIZES = {"tiny": {"memory_budget_gib": 0.2, "mode": "dynamic"}}
PROBE_STEPS = 2  # the first step allocates AdamW's state; the second runs with it resident


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="precision x checkpointing")
    search: str = knob("batch_size", choices=("batch_size", "seq_len"),
                       help="what grows until it no longer fits")
    mode: str = knob("grow", choices=("grow", "dynamic"),
                     help="grow: double then bisect; dynamic: start from the free memory")
    max_batch_size: int = knob(64, min=1, help="the search's cap on the micro-batch")
    effective_batch: int = knob(0, min=0, help="sequences per optimizer step, kept by "
                                               "accumulation (0: one micro-batch per step)")
    lr: float = knob(1e-3, min=0.0, help="AdamW learning rate")


def recipe(variant: str) -> Recipe:
    """The variant's combination: precision x checkpointing."""
    return Recipe(precision="bf16" if variant.startswith("bf16") else "fp32",
                  checkpointing="full" if variant.endswith("_ckpt") else "none")


def frontier_step(cfg: Config, sizes: list[int] | None = None) -> Trainer:
    """The variant's recipe composed on a batch of `sizes` micro-batches (consecutive rows of
    one fixed batch of their total), one optimizer step over them."""
    sizes = list(sizes or [cfg.batch_size])
    trainer = compose(dataclasses.replace(cfg, batch_size=sum(sizes)), recipe(cfg.variant), lr=cfg.lr)
    return apply_accumulation(trainer, sizes)


def micro_forward(trainer: Trainer) -> torch.Tensor:
    """The first micro-batch's loss (what one forward holds at a time)."""
    piece = next(trainer.micro_batches())
    return trainer.forward(piece.inputs, piece.targets)


def micro_batches(effective: int, micro: int) -> list[int]:
    """Sizes summing to `effective`, none above `micro`: [micro] * (steps - 1) + [the rest]."""
    steps = math.ceil(effective / micro)
    return [micro] * (steps - 1) + [effective - micro * (steps - 1)]


def at_size(cfg: Config, n: int) -> Config:
    """The config with the searched dimension (`batch_size` or `seq_len`) set to `n`."""
    return dataclasses.replace(cfg, **{cfg.search: n})


def probe_sizes(cfg: Config) -> list[int]:
    """What a probe runs per step: two micro-batches when accumulating (the second has the first's
    gradients resident, the accumulating peak), else one."""
    return [cfg.batch_size] * (2 if cfg.effective_batch else 1)


def step_sizes(cfg: Config) -> list[int]:
    """The micro-batches of one optimizer step at the size found (held in `cfg`)."""
    if not cfg.effective_batch:
        return [cfg.batch_size]
    return micro_batches(cfg.effective_batch, min(cfg.batch_size, cfg.effective_batch))


# ---------------------------------------------------------------- the search


def probe(cfg: Config, n: int, on_probe: Callable[[int, Trainer], None] | None = None) -> bool:
    """Does training at size `n` fit? PROBE_STEPS steps of a fresh trainer; afterwards (OOM or
    not) nothing of it is alive and the memory is back where it was before the probe."""
    return fits_in_memory(lambda: _run_probe(at_size(cfg, n), n, on_probe), cfg.device)


def _run_probe(cfg: Config, n: int, on_probe) -> None:
    # The trainer lives only in this frame (gone, with any traceback, when fits_in_memory frees)
    trainer = frontier_step(cfg, probe_sizes(cfg))
    if on_probe is not None:
        on_probe(n, trainer)
    for _ in range(PROBE_STEPS):
        trainer.step()


def search_frontier(cfg: Config, on_probe: Callable[[int, Trainer], None] | None = None) -> Search:
    """The largest size of `cfg.search` that fits, capped at `max_batch_size` (batch) or the
    model's context (sequence length). `on_probe(n, trainer)` sees each probe's trainer."""
    # grow doubles from 1; dynamic starts where the planner puts the free memory, then +1, +2, ...
    start = 1 if cfg.mode == "grow" else planner_max(cfg, free_bytes(cfg))
    return find_largest(lambda n: probe(cfg, n, on_probe), start=start, cap=search_cap(cfg), step=1)


def search_cap(cfg: Config) -> int:
    return cfg.max_batch_size if cfg.search == "batch_size" else cfg.model.max_seq_len


def budget_bytes(cfg: Config) -> int:
    """The virtual budget if set; on a GPU without one, what this process can have: the driver's
    free memory plus what PyTorch already holds (the CUDA context and other processes left out)."""
    if cfg.memory_budget_gib is not None:
        return int(cfg.memory_budget_gib * 2**30)
    free, _ = torch.cuda.mem_get_info(cfg.device)
    return free + torch.cuda.memory_reserved(cfg.device)


def free_bytes(cfg: Config) -> int:
    """What a probe may use now. CUDA: what this process can have less what it has allocated,
    within the virtual budget when one is set. CPU: the virtual budget, since the search holds
    nothing between probes (the technique cannot see the tracker's live bytes)."""
    if not cfg.device.startswith("cuda"):
        return budget_bytes(cfg)
    free, _ = torch.cuda.mem_get_info(cfg.device)
    free += torch.cuda.memory_reserved(cfg.device) - torch.cuda.memory_allocated(cfg.device)
    return free if cfg.memory_budget_gib is None else min(free, budget_bytes(cfg))


def planner_peak(cfg: Config, n: int) -> int:
    """The planner's peak for one training step at size `n` of the searched dimension."""
    at = at_size(cfg, n)
    sizes = probe_sizes(at)
    # the planner's micro-batch is the largest, sizes[0], of len(sizes)
    step = dataclasses.replace(at, batch_size=sizes[0] * len(sizes),
                               device=torch.device(cfg.device).type)
    plan = planned_memory(step, dataclasses.replace(recipe(cfg.variant), micro_batches=len(sizes)))
    return plan.total_bytes


def planner_max(cfg: Config, budget: int) -> int:
    """The napkin answer: the largest size (up to the cap) whose predicted peak fits `budget`."""
    return find_largest(lambda n: planner_peak(cfg, n) <= budget, start=1, cap=search_cap(cfg),
                        step=1).found


# ---------------------------------------------------------------- the experiment


def skip_reason(cfg: Config) -> str | None:
    cpu = not cfg.device.startswith("cuda")
    if cpu and cfg.memory_budget_gib is None:
        return ("on the CPU the search needs a virtual memory budget to run out of: set "
                "memory_budget_gib (e.g. --set memory_budget_gib=0.25)")
    if cfg.variant.startswith("bf16") and cpu:
        return emulated_bf16(cfg)
    if cfg.variant.startswith("bf16") and not cpu and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support (compute capability 8.0 or newer needed)"
    return None


def emulated_bf16(cfg: Config) -> str | None:
    """Why a bf16 search cannot run on this CPU, or None: its flags name no bf16 instructions, or
    its measured bf16 matmul is slower than fp32 (emulated: converted to fp32 and back)."""
    rates = hardware.ceilings(cfg.device, num_threads=cfg.num_threads).calibrated_tflops
    fp32, bf16 = rates.get("float32", 0.0), rates.get("bfloat16", 0.0)
    if hardware.cpu_info().native_bf16 and bf16 >= fp32:
        return None
    return (f"bf16 matmuls are emulated on this CPU (no AVX-512 BF16 or AMX at work: measured "
            f"{bf16 * 1e3:.3g} GFLOP/s against fp32's {fp32 * 1e3:.3g}): a search of tens of "
            "training steps would take many minutes")


def build(cfg: Config) -> Workload:
    state: dict = {}  # filled by check(): the search, then the trainer at the size found

    def check() -> dict[str, float]:
        start = time.perf_counter()
        search = search_frontier(cfg)
        if not search.found:
            raise torch.OutOfMemoryError(f"even {cfg.search}=1 does not fit in "
                                         f"{budget_bytes(cfg) / 2**30:.3f} GiB")
        if search.capped:
            wl.notes[f"max_{cfg.search}"] += (f" Capped at {search.cap} (max_batch_size, or the "
                                              "model's context): the frontier lies beyond.")
        found = at_size(cfg, search.found)
        trainer = frontier_step(found, step_sizes(found))
        state.update(search=search, trainer=trainer, search_s=time.perf_counter() - start)
        wl.tokens_per_step = sum(trainer.sizes) * found.seq_len  # known only now
        return {"found": search.found, "loss": trainer.step()}

    def report() -> dict[str, float]:
        search = state["search"]
        return {f"max_{cfg.search}": search.found, "num_probes": len(search.probes),
                "accumulation_steps": len(state["trainer"].sizes), "search_s": state["search_s"]}

    wl = Workload(
        step=lambda: state["trainer"].step(), check=check,
        tensors={"param_bytes": lambda: state["trainer"].model.parameters(),
                 "optimizer_bytes": lambda: state["trainer"].optimizer_tensors()},
        forward=lambda: micro_forward(state["trainer"]),
        resident=lambda: state["trainer"].model.parameters(), report=report,
        predicted=lambda: {"peak_mem_bytes": planner_peak(cfg, state["search"].found)},
        notes=notes(cfg), compute_dtype="bfloat16" if cfg.variant.startswith("bf16") else "float32")
    return wl


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Sizes differ by design; the finding is the gain over the reference's size."""
    return Comparison({"max_size_ratio": outputs["found"] / reference["found"]}, True)


def expected(cfg: Config) -> dict[str, float]:
    predicted = planner_max(cfg, budget_bytes(cfg))
    out: dict[str, float] = {f"max_{cfg.search}": predicted}
    if predicted:
        out["accumulation_steps"] = len(step_sizes(at_size(cfg, predicted)))
    return out


def notes(cfg: Config) -> dict[str, str]:
    size = f"max_{cfg.search}"
    bf16 = (" For bf16 the planner's fp32 recipe: autocast saves some activations in bf16 but "
            "keeps bf16 copies of the weights too." if cfg.variant.startswith("bf16") else "")
    return {
        size: (f"measured: the largest {cfg.search} whose {PROBE_STEPS} training steps ran without "
               f"OOM (the next size was probed and did not, unless capped); predicted: the largest "
               f"whose planner peak (training_memory().total_bytes) fits the budget.{bf16}"),
        "num_probes": ("doubling from 1, then bisecting" if cfg.mode == "grow" else
                       "from the planner's answer for the free memory at run time, then up or "
                       "bisecting down") + f"; each probe builds a model and optimizer and runs "
                                            f"{PROBE_STEPS} training steps.",
        "accumulation_steps": ("micro-batches per optimizer step that keep effective_batch "
                               "sequences per step (1 without a target)."),
        "peak_mem_bytes": "at the size found: the closer to the budget, the tighter the fit.",
    }


def budget_overrides(device: str, cpu_budget_gib: float) -> dict[str, float]:
    """For notebooks: a virtual budget on the CPU (which has none to run out of); none on a GPU,
    whose real memory is searched."""
    return {} if resolve_device(device).startswith("cuda") else {"memory_budget_gib": cpu_budget_gib}
