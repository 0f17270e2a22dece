"""Pipeline parallelism: the decoder cut into p stages, one per rank, fed m micro-batches a step.

- `single` (the reference): the plain training step on the whole batch, the same on every rank.
- `gpipe` (`ScheduleGPipe`): each stage runs the m forwards, then the m backwards; the first
  stage holds all m micro-batches' activations at the turn.
- `1f1b` (`Schedule1F1B`): stage i runs p - i warm-up forwards, then alternates a backward and a
  forward: at most p micro-batches in flight. It needs m >= p (a `skipped` row otherwise).

Stages are built by hand (`PipelineStage` around a `StageModule`): stage 0 holds the embedding
and the first blocks, the last stage the remaining blocks, the final norm, the head and the loss
(the schedule's `loss_fn`, a micro-batch's mean cross-entropy; `scale_grads` divides the summed
gradients by m), so the mean of the m losses and the gradients are the reference's. The cut is
measured: rank 0 times a forward + backward of the embedding, a block and the head + loss at
micro-batch size, and the cut minimises the slowest stage (the vocabulary head is heavy).

The bubble. With t_f forward and t_b backward per micro-batch on every stage and free sends, both
schedules idle each stage (p-1)(t_f + t_b) of a step of (m+p-1)(t_f + t_b): (p-1)/(m+p-1), the
`predicted` value. The measurement never uses it: each stage timestamps its compute (every
forward with its loss, every backward; send/recv waits fall between) on the host's monotonic
clock during the timed steps; the wall runs from the first compute start to the last compute end
on any rank (one host, one clock); a rank's bubble is 1 - busy / wall, in the fastest step.
Unequal stages, message latency and a busy host raise it (`stall_fraction` shows the last);
`delay_stage` + `stage_delay_ms` make one stage sleep in every forward to show the first.
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils._python_dispatch import _disable_current_modes

from labkit import planner
from labkit.config import ConfigError, knob
from labkit.distributed import DistConfig, clock, default_nproc, world_size
from labkit.model import build_model, rope_tables
from labkit.techniques.training import (Trainer, gradient_difference, lm_loss, make_batch,
                                        optimizer_state, step_with_gradients)
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("single", "gpipe", "1f1b")
REFERENCE = "single"
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# fp32, relative: the mean of m equal-sized micro-batch means against one mean, and m partial
# gradient sums against one sum, differ by a few ulps (1.2e-7 each).
LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-5
COST_REPEATS = 5  # timed runs per cost probe, after one warm-up


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="the reference, or a pipeline schedule")
    micro_batches: int = knob(2, min=1, help="m: micro-batches per step (they split batch_size)")
    delay_stage: int = knob(0, min=0, help="the stage that sleeps stage_delay_ms per forward")
    stage_delay_ms: float = knob(0.0, min=0.0, help="injected sleep in every micro-batch forward "
                                                    "of delay_stage (0: none)")


def num_stages(cfg: Config) -> int:
    return cfg.nproc or default_nproc(cfg.device)


def validate(cfg: Config) -> None:
    m, b, p, layers = cfg.micro_batches, cfg.batch_size, num_stages(cfg), cfg.model.num_layers
    if b % m:
        valid = ", ".join(str(d) for d in range(1, b + 1) if b % d == 0)
        raise ConfigError(f"micro_batches={m} does not divide batch_size={b}; valid: {valid} "
                          f"(or a batch_size that is a multiple of {m})")
    if layers < p - 1:
        raise ConfigError(f"num_layers={layers} is too few for {p} stages: every stage but the "
                          f"last needs a block; valid: num_layers >= {p - 1}")
    if cfg.delay_stage >= p:
        raise ConfigError(f"delay_stage={cfg.delay_stage} but there are {p} stages; "
                          f"valid: 0..{p - 1}")
    if cfg.dtype != "float32":
        raise ConfigError(f"pipeline_parallel trains in float32 (got {cfg.dtype}); precision is "
                          "the mixed_precision experiment's knob")
    if cfg.model.tie_embeddings:
        raise ConfigError("tie_embeddings=True puts one weight on the first and the last stage "
                          "(its gradients would need summing); valid: tie_embeddings=False")


def skip_reason(cfg: Config) -> str | None:
    p, m = num_stages(cfg), cfg.micro_batches
    if cfg.variant != REFERENCE and p < 2:
        return "a pipeline needs at least 2 stages (nproc >= 2)"
    if cfg.variant == "1f1b" and m < p:
        return (f"1F1B needs micro_batches >= stages (m={m} < p={p}): stage 0 starts with p "
                "forwards in flight")
    return None


class StageModule(nn.Module):
    """Blocks [lo, hi) of a decoder; the first stage adds the embedding, the last the final norm
    and the head. tokens (b, T) or hidden (b, T, d) -> hidden (b, T, d) or logits (b, T, vocab)."""

    def __init__(self, model: nn.Module, lo: int, hi: int, *, first: bool, last: bool):
        super().__init__()
        self.cfg, self.attention = model.cfg, model.attention
        self.embed = model.embed if first else None
        self.pos_embed = model.pos_embed if first else None
        self.layers = model.layers[lo:hi]
        self.norm, self.lm_head = (model.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        if self.embed is not None:
            x = self.embed(x)
            if self.pos_embed is not None:
                x = x + self.pos_embed(positions)
        rope = None if self.cfg.arch == "gpt2" else rope_tables(positions, self.cfg.head_dim,
                                                                  self.cfg.rope_theta)
        for layer in self.layers:
            x = layer(x, 0, None, self.attention, rope)
        return x if self.lm_head is None else self.lm_head(self.norm(x))


# --- where to cut: measured cost per part, then the split that balances the stages -------------

def _fastest_ms(fn, device: str) -> float:
    """The fastest of COST_REPEATS runs after a warm-up: noise on a shared host only adds time."""
    fn()
    times = []
    for _ in range(COST_REPEATS):
        start = clock(device)
        fn()
        times.append(clock(device) - start)
    return min(times) * 1e3


def measure_costs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                  device: str) -> dict[str, float]:
    """ms for a forward + backward of the embedding, one block, and the norm + head + loss, on one
    micro-batch (tokens (b/m, T)). Timed outside the harness's memory tracker: a dispatch mode
    that roughly doubles a block's many small ops but not the head's one large matmul."""
    stage = StageModule(model, 0, 1, first=False, last=False)
    x = model.embed(tokens).detach().requires_grad_()  # (b/m, T, d)
    probes = {"embed": lambda: model.embed(tokens).sum().backward(),
              "block": lambda: stage(x).sum().backward(),
              "head": lambda: lm_loss(model.lm_head(model.norm(x)), targets).backward()}
    with _disable_current_modes():
        costs = {part: _fastest_ms(fn, device) for part, fn in probes.items()}
    model.zero_grad(set_to_none=True)  # the probes' gradients must not reach the check
    return costs


def agreed_costs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                 device: str) -> dict[str, float]:
    """Rank 0 measures (the others wait, leaving it the CPU) and every rank gets its figures:
    ranks that timed for themselves could cut the model differently."""
    costs = [measure_costs(model, tokens, targets, device) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(costs, src=0)
    return costs[0]


def stage_cost(costs: dict[str, float], i: int, p: int, blocks: int) -> float:
    ends = (costs["embed"] if i == 0 else 0) + (costs["head"] if i == p - 1 else 0)
    return blocks * costs["block"] + ends


def balance(costs: dict[str, float], num_layers: int, p: int) -> list[int]:
    """Boundaries [0, b_1, ..., b_{p-1}, L]: stage i runs blocks [b_i, b_{i+1}). Minimises the
    slowest stage's cost; every stage but the last runs at least one block."""
    @functools.cache
    def best(i: int, lo: int) -> tuple[float, tuple[int, ...]]:
        if i == p - 1:
            return stage_cost(costs, i, p, num_layers - lo), (num_layers,)
        options = []
        for hi in range(lo + 1, num_layers - (p - 2 - i) + 1):  # leave a block per middle stage
            rest, bounds = best(i + 1, hi)
            options.append((max(stage_cost(costs, i, p, hi - lo), rest), (hi,) + bounds))
        return min(options)
    return [0, *best(0, 0)[1]]


# --- the pipeline: timed stage, schedule, measured bubble ----------------------------------------

class Spans:
    """Compute spans (start, end, cpu): seconds on the host's monotonic clock, and the seconds this
    thread ran on a CPU meanwhile (torch runs one intra-op thread per rank), one list per step."""

    def __init__(self, device: str):
        self.device, self.steps = device, []

    @contextlib.contextmanager
    def timed(self, simulated: bool = False):
        """`simulated`: an injected sleep, busy by definition (it stands for compute)."""
        # clock() synchronises a GPU: the span is the kernels' time, not their launch
        start, cpu = clock(self.device), time.thread_time()
        yield
        end = clock(self.device)
        self.steps[-1].append((start, end, end - start if simulated else time.thread_time() - cpu))


class TimedStage(PipelineStage):
    """A PipelineStage that records when it computes and, when told, sleeps in every forward (an
    injected slow stage: the sleep counts as busy, the other stages wait for it)."""

    def __init__(self, *args, spans: Spans, delay_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.spans, self.delay_s = spans, delay_s

    def forward_one_chunk(self, *args, **kwargs):
        if self.delay_s:
            with self.spans.timed(simulated=True):
                time.sleep(self.delay_s)
        with self.spans.timed():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.spans.timed():
            return super().backward_one_chunk(*args, **kwargs)


def bubble_metrics(every: list[list[list[tuple[float, float, float]]]], r: int) -> dict[str, float]:
    """every[rank][step] = that rank's spans in that step. Per step: wall from the first start to
    the last end on any rank, bubble_r = 1 - busy_r / wall. Reported for the fastest step: on a
    shared host another process can only stall a stage, which counts as busy on that rank and as
    wait on the others, pushing the bubble towards (p-1)/p; the fastest step was stalled least.
    `stall_fraction`: the share of a rank's compute spans its thread spent off the CPU (another
    process had the core); where it is more than a few percent the bubble measures the host."""
    steps = []
    for spans in zip(*every):  # one step, all ranks
        wall = max(s[1] for rank in spans for s in rank) - min(s[0] for rank in spans for s in rank)
        busy = [sum(end - start for start, end, _ in rank) for rank in spans]
        stall = [1 - sum(cpu for *_, cpu in rank) / b for rank, b in zip(spans, busy)]
        steps.append((wall, busy, stall))
    wall, busy, stall = min(steps)
    bubbles = [1 - b / wall for b in busy]
    return {"bubble_fraction": bubbles[r], "bubble_fraction_mean": sum(bubbles) / len(bubbles),
            "schedule_wall_ms": wall * 1e3, "stage_busy_ms": busy[r] * 1e3,
            "stall_fraction": stall[r], "stall_fraction_max": max(stall)}


class Pipeline:
    """This rank's stage, its schedule and its optimizer."""

    def __init__(self, cfg: Config):
        p, r, m = world_size(), dist.get_rank(), cfg.micro_batches
        self.cfg, self.rank = cfg, r
        model = build_model(cfg.model, device=cfg.device, seed=cfg.seed, attention=cfg.attention)
        self.inputs, self.targets = make_batch(cfg)  # (B, T) each: the reference's batch
        mb = cfg.batch_size // m
        self.costs = agreed_costs(model, self.inputs[:mb], self.targets[:mb], cfg.device)
        self.bounds = balance(self.costs, cfg.model.num_layers, p)
        self.module = StageModule(model, self.bounds[r], self.bounds[r + 1], first=r == 0,
                                  last=r == p - 1)  # the other stages' weights go with `model`
        ids = {id(t): n for n, t in model.named_parameters()}
        self.names = {n: ids[id(t)] for n, t in self.module.named_parameters()}  # -> the model's
        self.spans = Spans(cfg.device)
        delay = cfg.stage_delay_ms / 1e3 if r == cfg.delay_stage else 0.0
        self.stage = TimedStage(self.module, r, p, torch.device(cfg.device), spans=self.spans,
                                delay_s=delay)
        self.schedule = SCHEDULES[cfg.variant](self.stage, m, loss_fn=self.loss)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=1e-3)  # as Trainer's

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with self.spans.timed():
            return lm_loss(logits, target)

    def run_schedule(self) -> list[torch.Tensor]:
        """One step's forwards and backwards; the last stage returns the m losses."""
        self.spans.steps.append([])
        losses: list[torch.Tensor] = []
        args = (self.inputs,) if self.stage.is_first else ()
        kwargs = {"target": self.targets, "losses": losses} if self.stage.is_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return losses

    def update(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.run_schedule()
        self.update()

    def check(self) -> dict:
        losses = self.run_schedule()
        grads = {self.names[n]: t.grad.detach().cpu().numpy().copy()
                 for n, t in self.module.named_parameters()}
        self.update()
        # The batch's loss, the mean of the m micro-batch losses, from the last stage to all.
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(
            (), device=self.cfg.device)
        dist.broadcast(loss, src=world_size() - 1)
        return {"loss": loss.item(), "grads": grads}

    def stage_cost(self, i: int) -> float:
        return stage_cost(self.costs, i, len(self.bounds) - 1, self.bounds[i + 1] - self.bounds[i])

    def report(self) -> dict[str, float]:
        """The bubble of the timed steps (the last `timed_steps` recorded), gathered from every
        rank: the harness calls report() on every rank after the same timed steps."""
        every: list = [None] * world_size()
        dist.all_gather_object(every, self.spans.steps[-self.cfg.timed_steps:])
        out = bubble_metrics(every, self.rank)
        if self.cfg.device.startswith("cuda"):  # the GPU computes, the thread waits: no stall
            out = {k: v for k, v in out.items() if not k.startswith("stall")}
        return {**out, "stage_cost_ms": self.stage_cost(self.rank)}

    def predicted(self) -> dict[str, float]:
        """The planner's parameters for this stage's blocks, embedding and head; busy = m x its
        measured cost (+ sleep); the step = (m + p - 1) x the slowest stage's (the textbook
        pipeline paced by its slowest stage)."""
        cfg, r, p = self.cfg, self.rank, len(self.bounds) - 1
        shape = replace(cfg.model, num_layers=self.bounds[r + 1] - self.bounds[r])
        params = planner.stage_params(shape, first=r == 0, last=r == p - 1).total * 4  # fp32
        per_mb = [self.stage_cost(i) + (cfg.stage_delay_ms if i == cfg.delay_stage else 0.0)
                  for i in range(p)]
        return {"param_bytes": params, "optimizer_bytes": 2 * params,
                "stage_busy_ms": cfg.micro_batches * per_mb[r],
                "step_ms": (cfg.micro_batches + p - 1) * max(per_mb)}


def build_pipeline(cfg: Config) -> Workload:
    pipe = Pipeline(cfg)
    return Workload(
        step=pipe.step, check=pipe.check, tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": pipe.module.parameters,
                 "optimizer_bytes": lambda: optimizer_state(pipe.optimizer)},
        report=pipe.report, predicted=pipe.predicted, notes=notes(cfg, pipe.bounds, pipe.costs),
        compute_dtype=cfg.dtype, count_flops=False)


def build_single(cfg: Config) -> Workload:
    trainer = Trainer(cfg)
    return Workload(
        step=trainer.step, check=lambda: step_with_gradients(trainer),
        tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": trainer.model.parameters,
                 "optimizer_bytes": trainer.optimizer_tensors},
        forward=trainer.forward, resident=trainer.model.parameters, compute_dtype=cfg.dtype)


def build(cfg: Config) -> Workload:
    return build_single(cfg) if cfg.variant == REFERENCE else build_pipeline(cfg)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The batch's loss, and this rank's stage's gradients against the same parameters' in the
    reference, after one step from the same weights and batch."""
    loss_diff = abs(outputs["loss"] - reference["loss"]) / abs(reference["loss"])
    ref = {n: reference["grads"][n] for n in outputs["grads"]}
    max_abs, max_rel = gradient_difference(ref, outputs["grads"])
    ok = loss_diff <= LOSS_TOLERANCE and max_rel <= GRAD_TOLERANCE
    message = "" if ok else (f"loss relative difference {loss_diff:.2e} (<= {LOSS_TOLERANCE:g}), "
                             f"gradients max relative {max_rel:.2e} (<= {GRAD_TOLERANCE:g})")
    return Comparison({"loss": outputs["loss"], "loss_rel_diff": loss_diff,
                       "grad_max_abs_diff": max_abs, "grad_max_rel_diff": max_rel}, ok, message)


def expected(cfg: Config) -> dict[str, float]:
    if cfg.variant == REFERENCE:
        bytes_ = planner.param_bytes(cfg.model, cfg.dtype)
        return {"param_bytes": bytes_, "optimizer_bytes": 2 * bytes_}  # AdamW: two fp32 moments
    p, m = num_stages(cfg), cfg.micro_batches
    bubble = (p - 1) / (m + p - 1)
    return {"bubble_fraction": bubble, "bubble_fraction_mean": bubble}


def notes(cfg: Config, bounds: list[int], costs: dict[str, float]) -> dict[str, str]:
    p = len(bounds) - 1
    stages = []
    for i in range(p):
        lo, hi = bounds[i], bounds[i + 1]
        parts = (["embedding"] if i == 0 else []) + ([f"blocks {lo}..{hi - 1}"] if hi > lo else [])
        parts += ["head + loss"] if i == p - 1 else []
        stages.append(f"stage {i}: {' + '.join(parts)} ({stage_cost(costs, i, p, hi - lo):.2f} ms)")
    measured = ", ".join(f"{k} {v:.2f} ms" for k, v in costs.items())
    sleep = (f" Stage {cfg.delay_stage} sleeps {cfg.stage_delay_ms:g} ms a forward."
             if cfg.stage_delay_ms else "")
    return {"stage_cost_ms": f"{'; '.join(stages)}. Forward + backward per micro-batch on rank 0: "
                             f"{measured}.",
            "bubble_fraction": "1 - busy / wall in the fastest timed step; predicted "
                               f"(p-1)/(m+p-1): equal stages, free sends.{sleep}",
            "step_ms": "predicted: (m + p - 1) x the slowest stage's measured cost (+ sleep)."}
