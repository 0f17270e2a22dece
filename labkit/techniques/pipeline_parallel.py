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

The bubble, measured: each stage timestamps its compute (every forward with its loss, every
backward; send/recv waits fall between) on the host's monotonic clock during the timed steps; the
wall runs from the first compute start to the last compute end on any rank (one host, one clock);
a rank's bubble is 1 - busy / wall, in the fastest step.
Predicted: after the timed steps each stage times its own forward and backward of one micro-batch
while the others wait, and stages 0 and 1 time one activation's send and receive; `replay` runs
the schedule's ops on those durations (`labkit.blocks.pipeline_schedule`: a forward waits for
the previous stage's plus a handoff, a backward for the next stage's) and reads the bubble off the
replay as off the measurement. With equal stages and free handoffs that is (p-1)/(m+p-1),
`ideal_bubble_fraction`. What the replay leaves out, and the measurement holds, is the host: the schedule's own time between ops, a
waiting rank's wake-ups beyond one handoff, other processes on the cores (`stall_fraction`).
`delay_stage` + `stage_delay_ms` make one stage sleep in every forward (an unequal stage);
`corrupt` makes every stage send a wrong activation or gradient, which the check must catch.
"""
from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass, replace
from statistics import median

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from labkit import planner
from labkit.config import ConfigError, knob
from labkit.blocks.distributed import DistConfig, default_nproc, world_size
from labkit.measure.clock import clock, repeat_seconds
from labkit.measure.modes import unmetered
from labkit.blocks.model import build_model, rope_tables
from labkit.blocks.pipeline_schedule import ideal_bubble, replayed_bubbles, step_bubbles
from labkit.blocks.training import Trainer, compare_grads, lm_loss, make_batch, step_with_gradients
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("single", "gpipe", "1f1b")
REFERENCE = "single"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3, "seq_len": 32}, {"timed_steps": 2, "seq_len": 32, "num_layers": 2},
             {"timed_steps": 2, "seq_len": 32, "num_layers": 1})

SIZES = {"tiny": {"batch_size": 8}}  # micro_batches 1, 2, 4 and 8 each split the batch
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
# fp32, relative: the mean of m equal-sized micro-batch means against one mean, and m partial
# gradient sums against one sum, differ by a few ulps (1.2e-7 each).
LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-5
COST_REPEATS = 5  # timed runs per cost probe, after one warm-up
CALIBRATION_REPEATS = 7  # timed forward + backward runs per stage, after one round of warm-up
HANDOFF_REPEATS = 20  # timed round trips, after one warm-up
CORRUPTIONS = ("none", "activation", "gradient")
CORRUPTION = 1e-3  # relative error of a corrupted handoff: far above the check's tolerances


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="the reference, or a pipeline schedule")
    micro_batches: int = knob(2, min=1, help="m: micro-batches per step (they split batch_size)")
    delay_stage: int = knob(0, min=0, help="the stage that sleeps stage_delay_ms per forward")
    stage_delay_ms: float = knob(0.0, min=0.0, help="injected sleep in every micro-batch forward "
                                                    "of delay_stage (0: none)")
    corrupt: str = knob("none", choices=CORRUPTIONS,
                        help="inject a wrong handoff to watch the check catch it: every activation "
                             "a stage sends shifted, or every gradient scaled, by 0.1%")


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
        rope = None if self.cfg.arch == "gpt2" else rope_tables(
            positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_llama3)
        for layer in self.layers:
            x = layer(x, 0, None, self.attention, rope)
        return x if self.lm_head is None else self.lm_head(self.norm(x))


# --- where to cut: measured cost per part, then the split that balances the stages -------------

def _fastest_ms(fn, device: str) -> float:
    """The fastest of COST_REPEATS runs after a warm-up: noise on a shared host only adds time."""
    return min(repeat_seconds(fn, device=device, repeats=COST_REPEATS, warmup=1)) * 1e3


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
    with unmetered():
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
    injected slow stage: the sleep counts as busy, the other stages wait for it) or sends every
    activation or gradient CORRUPTION too large (an injected wrong handoff the check must catch)."""

    def __init__(self, *args, spans: Spans, delay_s: float = 0.0, corrupt: str = "none",
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.spans, self.delay_s, self.corrupt = spans, delay_s, corrupt

    def forward_one_chunk(self, *args, **kwargs):
        if self.delay_s:
            with self.spans.timed(simulated=True):
                time.sleep(self.delay_s)
        with self.spans.timed():
            return super().forward_one_chunk(*args, **kwargs)

    def backward_one_chunk(self, *args, **kwargs):
        with self.spans.timed():
            return super().backward_one_chunk(*args, **kwargs)

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._maybe_corrupt(super().get_fwd_send_ops(fwd_chunk_id), "activation")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._maybe_corrupt(super().get_bwd_send_ops(bwd_chunk_id), "gradient")

    def _maybe_corrupt(self, ops: list[dist.P2POp], kind: str) -> list[dist.P2POp]:
        """Copies (this stage's own autograd stays intact): a gradient scaled, which scales every
        earlier gradient alike; an activation shifted, since a scale would pass unseen through
        the next stage's RMSNorm where that stage is the head alone."""
        for op in ops if self.corrupt == kind else ():
            t = op.tensor
            op.tensor = (t * (1 + CORRUPTION) if kind == "gradient"
                         else t + CORRUPTION * t.abs().mean())
        return ops


def bubble_metrics(every: list[list[list[tuple[float, float, float]]]], r: int) -> dict[str, float]:
    """every[rank][step] = that rank's spans in that step. Per step: bubble_r = 1 - busy_r / wall.
    Reported for the fastest step: on a shared host another process can only stall a stage, which
    counts as busy on that rank and as wait on the others, pushing the bubble towards (p-1)/p; the
    fastest step was stalled least. `stall_fraction`: the share of a rank's compute spans its
    thread spent off the CPU (another process had the core); where it is more than a few percent
    the bubble measures the host."""
    steps = []
    for spans in zip(*every):  # one step, all ranks
        wall, busy = step_bubbles(list(spans))
        stall = [1 - sum(cpu for *_, cpu in rank) / b for rank, b in zip(spans, busy)]
        steps.append((wall, busy, stall))
    wall, busy, stall = min(steps)
    bubbles = [1 - b / wall for b in busy]
    return {"bubble_fraction": bubbles[r], "bubble_fraction_mean": sum(bubbles) / len(bubbles),
            "schedule_wall_ms": wall * 1e3, "stage_busy_ms": busy[r] * 1e3,
            "stall_fraction": stall[r], "stall_fraction_max": max(stall)}


class Pipeline:
    """This rank's stage, its schedule, and the plain training step over the stage's parameters
    (`trainer`), whose forwards and backwards are the schedule's (`Trainer.forward_backward`)."""

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
                                delay_s=delay, corrupt=cfg.corrupt)
        self.schedule = SCHEDULES[cfg.variant](self.stage, m, loss_fn=self.loss)
        self.trainer = Trainer(cfg, model=self.module)  # AdamW over this stage's parameters
        self.trainer.forward_backward, self.trainer.measure_norm = self.scheduled_loss, False

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

    def scheduled_loss(self) -> float:
        """One step's forwards and backwards by the schedule; the batch's mean loss on the last
        stage (nan on the others)."""
        losses = self.run_schedule()
        return torch.stack(losses).mean().item() if losses else math.nan

    def check(self) -> dict:
        losses = self.run_schedule()
        grads = {self.names[n]: t.grad.detach().cpu().numpy().copy()
                 for n, t in self.module.named_parameters()}
        self.trainer.update()
        # The batch's loss, the mean of the m micro-batch losses, from the last stage to all.
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(
            (), device=self.cfg.device)
        dist.broadcast(loss, src=world_size() - 1)
        return {"loss": loss.item(), "grads": grads}

    def stage_cost(self, i: int) -> float:
        return stage_cost(self.costs, i, len(self.bounds) - 1, self.bounds[i + 1] - self.bounds[i])

    def report(self) -> dict[str, float]:
        """The bubble of the timed steps (the last `timed_steps` recorded), gathered from every
        rank, then the calibration: the harness calls report() on every rank after the same
        timed steps."""
        every: list = [None] * world_size()
        dist.all_gather_object(every, self.spans.steps[-self.cfg.timed_steps:])
        out = bubble_metrics(every, self.rank)
        if self.cfg.device.startswith("cuda"):  # the GPU computes, the thread waits: no stall
            out = {k: v for k, v in out.items() if not k.startswith("stall")}
        self.fwd, self.bwd, self.handoff = self.calibration()
        p, m = len(self.fwd), self.cfg.micro_batches
        return {**out, "ideal_bubble_fraction": ideal_bubble(p, m),
                "stage_fwd_ms": self.fwd[self.rank] * 1e3,
                "stage_bwd_ms": self.bwd[self.rank] * 1e3, "handoff_ms": self.handoff * 1e3,
                "stage_cost_ms": self.stage_cost(self.rank)}

    def calibration(self) -> tuple[list[float], list[float], float]:
        """Every stage's forward and backward seconds per micro-batch, then one handoff: what the
        replay runs on. The stages take turns, one run each per round while the others wait, so
        that a busy spell on a shared host falls on every stage's sample alike."""
        runs = []
        for _ in range(1 + CALIBRATION_REPEATS):  # the first round warms up
            for s in range(world_size()):
                dist.barrier()
                if s == self.rank:
                    runs.append(self.time_stage())
        self.stage.clear_runtime_states()
        self.module.zero_grad(set_to_none=True)  # calibration's gradients reach no step
        # The median, not the fastest: the bubble is read from the fastest step, but a step sums
        # 2m ops, each about typical.
        own = (median(f for f, _ in runs[1:]), median(b for _, b in runs[1:]))
        every: list = [None] * world_size()
        dist.all_gather_object(every, own)
        dist.barrier()
        handoff = [self.time_handoff()]
        dist.broadcast_object_list(handoff, src=0)
        return [f for f, _ in every], [b for _, b in every], handoff[0]

    def time_stage(self) -> tuple[float, float]:
        """Seconds of this stage's forward (with the loss on the last stage and the sleep on a
        delayed one) and backward of one micro-batch, through the stage's own calls outside any
        schedule step."""
        mb = self.cfg.batch_size // self.cfg.micro_batches
        args = (self.inputs[:mb],) if self.stage.is_first else ()  # later stages: the last received
        self.spans.steps.append([])
        out = self.stage.forward_one_chunk(0, args, save_forward_output=False)
        loss = self.loss(out, self.targets[:mb]) if self.stage.is_last else None
        self.stage.backward_one_chunk(0, loss=loss, last_backward=True)
        *forward, backward = self.spans.steps.pop()
        return sum(end - start for start, end, _ in forward), backward[1] - backward[0]

    def time_handoff(self) -> float:
        """Seconds from stage 0 sending one activation (b/m, T, d) to stage 1 holding it, awake
        (a gradient is the same size): half the median of HANDOFF_REPEATS round trips, each
        one send and one wake-up of a blocked receiver per direction, as in the schedule."""
        if self.rank > 1:
            return 0.0
        cfg = self.cfg
        x = torch.zeros(cfg.batch_size // cfg.micro_batches, cfg.seq_len, cfg.model.hidden_size,
                        device=cfg.device)
        trips = []
        for _ in range(1 + HANDOFF_REPEATS):
            start = clock(cfg.device)
            for send in ((True, False) if self.rank == 0 else (False, True)):
                (dist.send if send else dist.recv)(x, 1 - self.rank)
            trips.append(clock(cfg.device) - start)
        return median(trips[1:]) / 2

    def predicted(self) -> dict[str, float]:
        """The planner's parameters for this stage's blocks, embedding and head; the bubble,
        busy time and wall of the schedule replayed on the calibration (report() measured it)."""
        cfg, r, p, m = self.cfg, self.rank, len(self.bounds) - 1, self.cfg.micro_batches
        shape = replace(cfg.model, num_layers=self.bounds[r + 1] - self.bounds[r])
        params = planner.stage_params(shape, first=r == 0, last=r == p - 1).total * 4  # fp32
        wall, bubbles = replayed_bubbles(cfg.variant, m, self.fwd, self.bwd, self.handoff)
        return {"param_bytes": params, "optimizer_bytes": 2 * params,
                "bubble_fraction": bubbles[r], "bubble_fraction_mean": sum(bubbles) / p,
                "schedule_wall_ms": wall * 1e3,
                "stage_busy_ms": m * (self.fwd[r] + self.bwd[r]) * 1e3}


def build_pipeline(cfg: Config) -> Workload:
    pipe = Pipeline(cfg)
    return Workload(
        step=pipe.trainer.step, check=pipe.check, tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": pipe.module.parameters, "optimizer_bytes": pipe.trainer.optimizer_tensors},
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
    stage = {"grads": {n: reference["grads"][n] for n in outputs["grads"]}}  # this rank's stage
    return compare_grads(stage, outputs, GRAD_TOLERANCE, extra={"loss_rel_diff": loss_diff},
                         limits={"loss_rel_diff": LOSS_TOLERANCE})


def expected(cfg: Config) -> dict[str, float]:
    if cfg.variant == REFERENCE:
        bytes_ = planner.param_bytes(cfg.model, cfg.dtype)
        return {"param_bytes": bytes_, "optimizer_bytes": 2 * bytes_}  # AdamW: two fp32 moments
    p, m = num_stages(cfg), cfg.micro_batches
    return {"ideal_bubble_fraction": ideal_bubble(p, m)}


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
            "bubble_fraction": "1 - busy / wall in the fastest timed step. predicted: the schedule "
                               "replayed on each stage's forward and backward of a micro-batch "
                               "and one handoff, timed alone after the timed steps (stage_fwd_ms, "
                               "stage_bwd_ms, handoff_ms). It departs from ideal_bubble_fraction "
                               "by the stages' unequal compute and the handoffs; the measured "
                               "bubble departs from it by what the calibration does not hold: the "
                               "schedule's host time between ops and a waiting rank's wake-ups "
                               "beyond one handoff, and other processes on the cores "
                               f"(stall_fraction).{sleep}",
            "ideal_bubble_fraction": "(p-1)/(m+p-1): equal stages and free handoffs."}
