"""Activation checkpointing: keep fewer activations for backward and recompute the rest.

`apply_checkpointing(trainer, mode, ...)` (`labkit.blocks.transforms`) wraps chosen decoder blocks
in non-reentrant `torch.utils.checkpoint`; the model itself stays unchanged (a transform from
outside).
- `full`: every block saves only its input; its forward runs again in backward.
- `every_n`: every n-th block, a middle ground.
- `selective`: every block, but the outputs of matmul-type ops are kept (they are costly to
  recompute) and the cheap elementwise ops (norms, activations, RoPE, softmax) are recomputed.
- `blocks`: an explicit set of block indices (what the memory-budget variant chooses).

The experiment trains the same step with each mode (`none` is the reference; `budget` chooses the
blocks that make a memory budget fit, from a measured per-block table of bytes freed against time
recomputed). Recomputation replays the same ops, so the gradients must equal `none`'s.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from labkit import hardware, planner
from labkit.config import ConfigError, RunConfig, knob
from labkit.measure.clock import repeat_seconds
from labkit.measure.memory import SavedTensorMeter, tensors_in
from labkit.blocks.model import Decoder
from labkit.blocks.training import Trainer, compare_grads, step_with_gradients
from labkit.blocks.transforms import apply_checkpointing, checkpointed_blocks
from labkit.workload import Comparison, Workload

# --- The experiment: the same training step with each mode ---------------------------------------

VARIANTS = ("none", "full", "every_n", "selective", "budget")
REFERENCE = "none"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"batch_size": 2}, {"batch_size": 1, "seq_len": 32, "num_layers": 2})

# Gradients after one step must equal `none`'s on the CPU: recomputation replays the same kernels
# on the same inputs. On CUDA the embedding and attention backwards accumulate with atomics in a
# run-to-run order: an H200 measured a normwise relative difference of 3.6e-6 (medium preset, fp32,
# 8 x 1024 tokens; ~30 ulps), so there 1e-5 is allowed.
GRAD_TOLERANCE = {"cpu": 0.0, "cuda": 1e-5}
TIMING_REPEATS = 3  # timed forwards of one block for the budget's table (the median is kept)


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="which blocks recompute in backward")
    every: int = knob(2, min=1, help="every_n: checkpoint blocks 0, n, 2n, ...")
    activation_budget_gib: float | None = knob(
        None, min=0.0, help="budget: activation bytes allowed; none: memory_budget_gib "
                            "(else a GPU's free memory) for the whole step")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"checkpointing trains in float32 (got {cfg.dtype}); precision is the "
                          "mixed_precision experiment's knob")


def build(cfg: Config) -> Workload:
    trainer = Trainer(cfg)
    model = trainer.model
    blocks, budget_note = budget_blocks(cfg, model, trainer.inputs) if cfg.variant == "budget" else ((), "")
    mode = "blocks" if cfg.variant == "budget" else cfg.variant
    apply_checkpointing(trainer, mode, every=cfg.every, blocks=blocks)
    num_blocks = len(checkpointed_blocks(len(model.layers), mode, every=cfg.every, blocks=blocks))
    return Workload(
        step=trainer.step, check=lambda: step_with_gradients(trainer),
        tokens_per_step=cfg.batch_size * cfg.seq_len,
        forward=trainer.forward, resident=model.parameters,
        report=lambda: {"num_checkpointed_blocks": num_blocks},
        notes=notes(cfg, budget_note), compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Every gradient after one step from the same weights and batch, against `none`'s."""
    tolerance = GRAD_TOLERANCE["cuda" if cfg.device.startswith("cuda") else "cpu"]
    return compare_grads(reference, outputs, tolerance)


# --- budget: which blocks to checkpoint, from a measured per-block table --------------------------

@dataclass(frozen=True)
class BlockCost:
    """One block's row of the table: bytes checkpointing it frees, seconds it costs again."""

    index: int
    saved_bytes: int  # held for backward plain, less held checkpointed (its input)
    recompute_s: float  # one more forward of the block, in backward


def budget_bytes(cfg: Config) -> tuple[int | None, str]:
    """The budget and what it bounds. An explicit activation budget bounds the activations;
    otherwise the step's peak is bounded by `memory_budget_gib`, or on CUDA by the memory this
    process could take: free plus what the caching allocator holds already (so the figure does
    not shrink as this variant allocates). A CPU has no budget unless one is given."""
    if cfg.activation_budget_gib is not None:
        return int(cfg.activation_budget_gib * 2**30), "activations"
    if cfg.memory_budget_gib is not None:
        return int(cfg.memory_budget_gib * 2**30), "step's peak"
    if cfg.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(cfg.device)
        return free + torch.cuda.memory_reserved(cfg.device), "step's peak"
    return None, ""


def planned_figure(cfg: Config, what: str, num_blocks: int) -> int:
    """The planner's bytes of `what` (activations or the step's peak) with `num_blocks` blocks
    fully checkpointed."""
    plan = plan_memory(cfg, "full" if num_blocks else "none", num_blocks or None)
    return plan.activation_bytes if what == "activations" else plan.total_bytes


def budget_blocks(cfg: Config, model: Decoder, inputs: torch.Tensor) -> tuple[tuple[int, ...], str]:
    """The blocks `budget` checkpoints: the planner's figure without checkpointing, less the
    bytes the measured table says each block frees, must fit; and a note that says why."""
    budget, what = budget_bytes(cfg)
    if budget is None:
        return (), "No budget on a CPU unless given (activation_budget_gib or memory_budget_gib)."
    plain = planned_figure(cfg, what, 0)
    floor = planned_figure(cfg, what, cfg.model.num_layers)  # the least any choice can reach
    gib = f"budget {budget / 2**30:.4f} GiB for the {what}, {plain / 2**30:.4f} GiB predicted plain"
    if plain <= budget:
        return (), f"{gib}: it fits without checkpointing."
    costs = block_costs(model, inputs)
    blocks = choose_blocks(costs, plain - budget)
    fits = max(floor, plain - sum(costs[i].saved_bytes for i in blocks)) <= budget
    return blocks, (f"{gib}; measured per block: {costs[0].saved_bytes / 2**20:.2f} MiB freed for "
                    f"{costs[0].recompute_s * 1e3:.2f} ms recomputed; checkpointed: {list(blocks)}"
                    + ("." if fits else f"; predicted not to fit (at least {floor / 2**30:.4f} GiB)."))


def block_costs(model: Decoder, inputs: torch.Tensor) -> list[BlockCost]:
    """The table, one row per block. This decoder's blocks share one shape, so block 0 is measured
    at the run's batch and its row serves them all (unlike blocks would be measured each)."""
    block, args = model.layers[0], block_arguments(model, inputs, 0)
    plain = held_bytes(lambda: block(*args), model, args[1:])
    kept = held_bytes(lambda: checkpoint(block, *args, use_reentrant=False), model, args[1:])
    seconds = forward_seconds(lambda: block(*args), inputs.device)
    return [BlockCost(i, plain - kept, seconds) for i in range(len(model.layers))]


def block_arguments(model: Decoder, inputs: torch.Tensor, index: int) -> tuple:
    """What block `index` is called with in a forward pass of `inputs`: its input (B, T, d),
    detached and requiring grad as inside the model, then start_pos, cache, attention, rope."""
    captured = []
    hook = model.layers[index].register_forward_pre_hook(lambda _, args: captured.append(args))
    try:
        with torch.no_grad():
            model(inputs)
    finally:
        hook.remove()
    x, *rest = captured[0]
    return (x.detach().requires_grad_(True), *rest)


def held_bytes(forward, model: Decoder, shared: tuple) -> int:
    """Bytes of the distinct storages `forward` saves for backward, less the parameters and
    `shared` (the RoPE tables: one copy serves every block). A checkpointed block saves its input."""
    with SavedTensorMeter([*model.parameters(), *tensors_in(shared)]) as saved:
        forward()
    return saved.total_bytes + saved.weight_copy_bytes


def forward_seconds(forward, device: torch.device) -> float:
    """Median wall time of a forward with grad (what recomputation runs), after one warm-up."""
    return statistics.median(repeat_seconds(forward, device=str(device), repeats=TIMING_REPEATS,
                                            warmup=1))


def choose_blocks(costs: list[BlockCost], excess_bytes: int) -> tuple[int, ...]:
    """Greedy: the most bytes freed per second recomputed first, until `excess_bytes` are freed.
    Ties go to earlier blocks: block i is recomputed in backward once the blocks after it have
    freed their activations, so an early block's recomputation adds least to the peak."""
    chosen, freed = [], 0
    for cost in sorted(costs, key=lambda c: (-c.saved_bytes / max(c.recompute_s, 1e-12), c.index)):
        if freed >= excess_bytes:
            break
        chosen.append(cost.index)
        freed += cost.saved_bytes
    return tuple(sorted(chosen))


# --- The napkin math ------------------------------------------------------------------------------

def plan_memory(cfg: Config, checkpointing: str = "none", layers: int | None = None):
    """The planner's MemoryPlan of this run's training step (fp32 weights, AdamW)."""
    return planner.training_memory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                   precision="fp32", optimizer="adamw", device=cfg.device,
                                   checkpointing=checkpointing, checkpointed_layers=layers)


def planned_blocks(cfg: Config) -> int:
    """How many blocks the variant checkpoints; for `budget`, the fewest the planner says fit."""
    num_layers = cfg.model.num_layers
    if cfg.variant != "budget":
        return len(checkpointed_blocks(num_layers, cfg.variant, every=cfg.every))
    budget, what = budget_bytes(cfg)
    if budget is None:
        return 0
    fitting = (k for k in range(num_layers + 1) if planned_figure(cfg, what, k) <= budget)
    return next(fitting, num_layers)


def recompute_flops(cfg: Config, num_blocks: int) -> int:
    """One more forward of each checkpointed block, less its MLP's down-projection: recomputation
    stops once the last tensor backward needs is rebuilt (torch.utils.checkpoint's early stop),
    and no backward needs that matmul's output. `selective` keeps matmul and attention outputs
    and recomputes only elementwise ops, which FLOP counts leave out: 0."""
    if cfg.variant == "selective":
        return 0
    m, tokens = cfg.model, cfg.batch_size * cfg.seq_len
    blocks = planner.forward_flops(m, batch=cfg.batch_size, new=cfg.seq_len, keys=cfg.seq_len, logits=0)
    return num_blocks * (blocks // m.num_layers - 2 * tokens * m.ffn_size * m.hidden_size)


def expected(cfg: Config) -> dict[str, float]:
    k = planned_blocks(cfg)
    kind = "selective" if cfg.variant == "selective" else ("full" if k else "none")
    plan = plan_memory(cfg, kind, k if k and cfg.variant in ("every_n", "budget") else None)
    flops = planner.train_step_flops(cfg.model, batch=cfg.batch_size, seq_len=cfg.seq_len,
                                     attention=cfg.attention) + recompute_flops(cfg, k)
    out = {"peak_mem_bytes": plan.total_bytes, "activation_bytes": plan.activation_bytes,
           "flops": flops, "num_checkpointed_blocks": k, "grad_max_abs_diff": 0.0,
           "grad_max_rel_diff": 0.0}
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(cfg.dtype)
    if peak:
        step_s = flops / (peak * 1e12)
        out.update(tflops=peak, step_ms=step_s * 1e3, tokens_per_s=cfg.batch_size * cfg.seq_len / step_s)
    return out


HELD = {"none": "every block keeps what its backward needs (norms, q/k/v, attention, the MLP's "
                "(B, T, ffn) tensors).",
        "full": "each block keeps only its input (B, T, d); the rest is the head's: the final "
                "norm's input and the loss's (B, T, vocab) log-probabilities.",
        "every_n": "blocks 0, n, 2n, ... (n = every) keep only their input, the others everything.",
        "selective": "each block keeps its matmul and attention outputs; the elementwise ops "
                     "(norms, RoPE, the activation function) are recomputed.",
        "budget": "the blocks chosen for the budget keep only their input."}


def notes(cfg: Config, budget_note: str = "") -> dict[str, str]:
    """What to read in the numbers, for this variant."""
    out = {"activation_bytes": f"predicted by the planner; {HELD[cfg.variant]}",
           "step_ms": "predicted: the step's FLOPs at the device's peak. Recomputation's time "
                      "cost is this row against none's: its FLOPs plus the elementwise ops replayed."}
    if cfg.variant != REFERENCE:
        out["flops"] = ("predicted: the plain step plus one more forward of each checkpointed "
                        "block, less its MLP down-projection (recomputation stops early).")
        out["loss"] = (f"gradients compared with {REFERENCE}'s after one step from the same weights "
                       "and batch: the grad_* rows.")
    if budget_note:
        out["num_checkpointed_blocks"] = f"{budget_note} Predicted: the fewest the planner says fit."
    return out
