"""Pipeline parallelism: the decoder cut into stage modules over p ranks, m micro-batches a step.

- `single` (the reference): the plain training step on the whole batch, the same on every rank.
- `gpipe`, `1f1b`: one stage per rank (`ScheduleGPipe`, `Schedule1F1B`; 1F1B needs m >= p).
- `interleaved_1f1b`: v = `virtual_stages` modules per rank, looping (stage s on rank s mod p).
- `zero_bubble` (`ScheduleInterleavedZeroBubble`, ZB1P): v modules per rank, each backward split
  into I (to the input, sent on at once) and W (to the weights, run later to fill the bubble).
- `zbv` (`ScheduleZBVZeroBubble`): two modules per rank in a V (rank r holds r and 2p-1-r).
The cut balances the measured cost of the p·v modules, or follows `stage_layers` (blocks per
module; `block_cost_ms` gives every block an injected per-layer cost, so that the split sets each
stage's work); the mean of the m losses and every gradient must equal the reference's. Measured
per rank: the bubble (1 - busy / wall from compute timestamps), predicted by replaying the live
schedule's own action list on each module's timed F, B (or I and W) and one handoff; the
saved-for-backward peak against the planner's bytes per micro-batch on the same actions.
`corrupt` injects a wrong handoff or a dropped W.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from statistics import median

import torch
import torch.distributed as dist
from torch import nn

from labkit import planner
from labkit.blocks.distributed import DistConfig, default_nproc, world_size
from labkit.blocks.model import build_model
from labkit.blocks.pipeline_schedule import (LOOPED, SCHEDULES, SPLIT, actions_of, bubbles, in_flight,
                                             local_stages, rank_of, replay_actions, stages_per_rank,
                                             timeline, torch_orders)
from labkit.blocks.pipeline_stages import (Spans, StageModule, TimedStage, agreed_costs,
                                           balance, bubble_metrics, min_layers, stage_cost)
from labkit.blocks.training import Trainer, compare_grads, lm_loss, make_batch, step_with_gradients
from labkit.config import ConfigError, knob
from labkit.measure.clock import clock
from labkit.measure.comm import CommCounter
from labkit.measure.memory import SavedBytes
from labkit.planner import pipeline as pipe_plan
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("single", "gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
REFERENCE = "single"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 1}, {"timed_steps": 1, "batch_size": 3, "micro_batches": 3, "seq_len": 16},
             {"timed_steps": 1, "batch_size": 2, "micro_batches": 2, "seq_len": 16,
              "num_layers": 2})  # the last: m < 2p - 1, ZBV skipped

SIZES = {"tiny": {"batch_size": 4, "micro_batches": 4, "seq_len": 32, "timed_steps": 2}}
# fp32, relative: the mean of m equal-sized micro-batch means against one mean, and m partial
# gradient sums against one sum, differ by a few ulps (1.2e-7 each).
LOSS_TOLERANCE = 1e-6
GRAD_TOLERANCE = 1e-5
CALIBRATION_REPEATS = 3  # timed forward + backward runs per stage module, after one warm-up round
HANDOFF_REPEATS = 10  # timed round trips, after one warm-up
_COSTS: dict[tuple, dict[str, float]] = {}  # measured once per rank process and size: every
# variant of a run cuts the model alike, and the probes are not paid again
CORRUPTIONS = ("none", "activation", "gradient", "skip_w")


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="the reference, or a pipeline schedule")
    micro_batches: int = knob(2, min=1, help="m: micro-batches per step (they split batch_size)")
    virtual_stages: int = knob(2, min=1, help="v: stage modules per rank of interleaved_1f1b and "
                                              "zero_bubble (zbv: always 2)")
    delay_stage: int = knob(0, min=0, help="the rank whose stage modules sleep stage_delay_ms "
                                           "per micro-batch forward, shared among them")
    stage_delay_ms: float = knob(0.0, min=0.0, help="injected sleep in every micro-batch forward "
                                                    "of delay_stage (0: none)")
    stage_layers: str = knob("", help="blocks each stage module holds, comma-separated, in order "
                                      "(e.g. 2,0: both on module 0, the last module the head "
                                      "alone); empty: the split that balances the measured cost")
    block_cost_ms: float = knob(0.0, min=0.0, help="injected sleep per block in every micro-batch "
                                                   "forward: a per-layer cost, so a stage's work "
                                                   "follows the blocks it holds (0: none)")
    corrupt: str = knob("none", choices=CORRUPTIONS,
                        help="inject a bug to watch the check catch it: every activation a stage "
                             "sends shifted, or every gradient scaled, by 0.1%; or (split "
                             "schedules) micro-batch 0's weight-gradient step W dropped")


def reference_ignores(cfg: Config) -> tuple[str, ...]:
    """The knobs `single` (one plain step on the whole batch) does not read: the pipeline's."""
    return ("micro_batches", "virtual_stages", "delay_stage", "stage_delay_ms", "stage_layers",
            "block_cost_ms", "corrupt")


def num_stages(cfg: Config) -> int:
    return cfg.nproc or default_nproc(cfg.device)


def num_modules(cfg: Config) -> int:
    """Stage modules in all: p, or p·v where each rank holds v."""
    return num_stages(cfg) * stages_per_rank(cfg.variant, cfg.virtual_stages)


def validate(cfg: Config) -> None:
    m, b, p, layers = cfg.micro_batches, cfg.batch_size, num_stages(cfg), cfg.model.num_layers
    if b % m:
        valid = ", ".join(str(d) for d in range(1, b + 1) if b % d == 0)
        raise ConfigError(f"micro_batches={m} does not divide batch_size={b}; valid: {valid} "
                          f"(or a batch_size that is a multiple of {m})")
    if layers < min_layers(p):
        raise ConfigError(f"num_layers={layers} is too few for {p} stages: every middle stage "
                          f"needs a block; valid: num_layers >= {min_layers(p)}")
    if cfg.delay_stage >= p:
        raise ConfigError(f"delay_stage={cfg.delay_stage} but there are {p} stages; "
                          f"valid: 0..{p - 1}")
    given_layers(cfg)  # a ConfigError for a malformed stage_layers
    if cfg.dtype != "float32":
        raise ConfigError(f"pipeline_parallel trains in float32 (got {cfg.dtype}); precision is "
                          "the mixed_precision experiment's knob")
    if cfg.model.tie_embeddings:
        raise ConfigError("tie_embeddings=True puts one weight on the first and the last stage "
                          "(its gradients would need summing); valid: tie_embeddings=False")


def given_layers(cfg: Config) -> list[int] | None:
    """stage_layers as blocks per stage module (None: balance the measured cost); a ConfigError
    unless they are whole numbers that add up to num_layers."""
    if not cfg.stage_layers:
        return None
    try:
        counts = [int(part) for part in cfg.stage_layers.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0 or sum(counts) != cfg.model.num_layers:
        raise ConfigError(f"stage_layers={cfg.stage_layers!r} must be blocks per stage module, "
                          f"comma-separated, adding up to num_layers={cfg.model.num_layers}; "
                          "valid: e.g. " + ",".join(["1"] * cfg.model.num_layers) + ", or empty")
    return counts


def skip_reason(cfg: Config) -> str | None:
    p, m, v = num_stages(cfg), cfg.micro_batches, cfg.variant
    if v == REFERENCE:
        return None
    counts = given_layers(cfg)
    if counts is not None and (len(counts) != num_modules(cfg) or 0 in counts[1:-1]):
        return (f"stage_layers={cfg.stage_layers!r} must give each of the {num_modules(cfg)} stage "
                "modules of this schedule its blocks, at least one for every middle module")
    if p < 2:
        return "a pipeline needs at least 2 stages (nproc >= 2)"
    if cfg.model.num_layers < min_layers(num_modules(cfg)):
        return (f"{num_modules(cfg)} stage modules need num_layers >= "
                f"{min_layers(num_modules(cfg))} (one block per middle module)")
    least = 2 * p - 1 if v == "zbv" else p if v != "gpipe" else 1
    if m < least:
        return (f"{v} needs micro_batches >= {'2p-1' if v == 'zbv' else 'stages'} (m={m} < {least}, "
                f"p={p}): fewer leave its warm-up unfilled")
    if v in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // p):
        return f"torch's {v} needs m a multiple of max(1, m // p) = {m // p} (m={m}, p={p})"
    if cfg.corrupt == "skip_w" and v not in SPLIT:
        return "skip_w drops a weight-gradient step: only zero_bubble and zbv split the backward"
    return None


class Pipeline:
    """This rank's stage modules, their schedule, and the plain training step over their
    parameters (`trainer`), whose forwards and backwards are the schedule's."""

    def __init__(self, cfg: Config):
        p, r, m = world_size(), dist.get_rank(), cfg.micro_batches
        self.cfg, self.rank, self.n = cfg, r, num_modules(cfg)
        self.split = cfg.variant in SPLIT
        model = build_model(cfg.model, device=cfg.device, seed=cfg.seed, attention=cfg.attention)
        self.inputs, self.targets = make_batch(cfg)  # (B, T) each: the reference's batch
        mb = cfg.batch_size // m
        key = (repr(cfg.model), mb, cfg.seq_len, cfg.device, cfg.attention, p)
        if key not in _COSTS:  # the same key on every rank: all measure, or none
            _COSTS[key] = agreed_costs(model, self.inputs[:mb], self.targets[:mb], cfg.device)
        self.costs = _COSTS[key]
        counts = given_layers(cfg)
        self.bounds = (balance(self.costs, cfg.model.num_layers, self.n) if counts is None
                       else [sum(counts[:i]) for i in range(self.n + 1)])
        self.ids = local_stages(cfg.variant, r, p, cfg.virtual_stages)  # this rank's modules
        self.modules = nn.ModuleList(
            StageModule(model, self.bounds[s], self.bounds[s + 1], first=s == 0, last=s == self.n - 1)
            for s in self.ids)  # the other ranks' weights go with `model`
        names = {id(t): n for n, t in model.named_parameters()}
        self.names = {n: names[id(t)] for n, t in self.modules.named_parameters()}  # -> the model's
        self.spans, self.held = Spans(cfg.device), [0, 0]
        delay = cfg.stage_delay_ms / 1e3 / len(self.ids) if r == cfg.delay_stage else 0.0
        self.stages = [TimedStage(mod, s, self.n, torch.device(cfg.device), spans=self.spans,
                                  held=self.held, corrupt=cfg.corrupt,
                                  delay_s=delay + cfg.block_cost_ms / 1e3 * self.blocks(s))
                       for mod, s in zip(self.modules, self.ids)]
        looped = cfg.variant in LOOPED
        self.schedule = SCHEDULES[cfg.variant](self.stages if looped else self.stages[0], m,
                                               loss_fn=self.loss)
        self.orders = torch_orders(cfg.variant, p, m, cfg.virtual_stages)
        if looped and actions_of(self.schedule.pipeline_order) != self.orders:
            raise RuntimeError(f"torch's {cfg.variant} issues other actions than "
                               "labkit.blocks.pipeline_schedule.torch_orders replays")
        self.trainer = Trainer(cfg, model=self.modules)  # AdamW over this rank's parameters
        self.trainer.forward_backward, self.trainer.measure_norm = self.scheduled_loss, False
        self.saved, self.comm = SavedBytes(), None

    @property
    def holds_first(self) -> bool:
        return 0 in self.ids

    @property
    def holds_last(self) -> bool:
        return self.n - 1 in self.ids

    def loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        with self.spans.timed():
            return lm_loss(logits, target)

    def run_schedule(self) -> list[torch.Tensor]:
        """One step's forwards and backwards; the rank with the last module returns the m losses."""
        self.spans.steps.append([])
        self.held[:] = [0, 0]
        losses: list[torch.Tensor] = []
        args = (self.inputs,) if self.holds_first else ()
        kwargs = {"target": self.targets, "losses": losses} if self.holds_last else {}
        self.schedule.step(*args, return_outputs=False, **kwargs)
        return losses

    def scheduled_loss(self) -> float:
        """One step by the schedule; the first (the harness's memory step, after the check) under
        a CommCounter: the first step's shape and metadata exchange is behind it."""
        counting = self.comm is None
        with CommCounter() if counting else contextlib.nullcontext() as counter:
            losses = self.run_schedule()
        self.comm = counter if counting else self.comm
        return torch.stack(losses).mean().item() if losses else math.nan

    def check(self) -> dict:
        """One step under the saved-tensor meter: the loss, every gradient, and the peaks of the
        saved bytes and of the micro-batches held."""
        with SavedBytes(self.modules.parameters()) as self.saved:
            losses = self.run_schedule()
        self.peak_held = self.held[1]
        grads = {self.names[n]: t.grad.detach().cpu().numpy().copy()
                 for n, t in self.modules.named_parameters()}
        self.trainer.update()
        # The batch's loss, the mean of the m micro-batch losses, from the last module's rank.
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros(
            (), device=self.cfg.device)
        dist.broadcast(loss, src=rank_of(self.cfg.variant, world_size())(self.n - 1))
        return {"loss": loss.item(), "grads": grads}

    def report(self) -> dict[str, float]:
        """The bubble of the timed steps (the last `timed_steps` recorded), gathered from every
        rank, then the calibration (every rank calls report() after the same timed steps), the
        idle time split by the replay, and the check's saved-bytes and in-flight peaks."""
        every: list = [None] * world_size()
        dist.all_gather_object(every, self.spans.steps[-self.cfg.timed_steps:])
        out = bubble_metrics(every, self.rank)
        if self.cfg.device.startswith("cuda"):  # the GPU computes, the thread waits: no stall
            out = {k: v for k, v in out.items() if not k.startswith("stall")}
        self.times, self.handoff = self.calibration()
        mine = {kind: sum(t for (s, k), t in self.times.items() if s in self.ids and k == kind)
                for kind in ("F", "B", "I", "W")}
        backward = {"stage_bwd_ms": mine["I"] + mine["W"]} if self.split else {"stage_bwd_ms": mine["B"]}
        split = {"stage_input_grad_ms": mine["I"], "stage_weight_grad_ms": mine["W"]} if self.split else {}
        idle_ms = out["schedule_wall_ms"] - out["stage_busy_ms"]
        compute, handoff = (self.replayed_idle(h) for h in (0.0, self.handoff))
        return {**out, "ideal_bubble_fraction": ideal_bubble(self.cfg),
                "idle_ms": idle_ms, "idle_schedule_ms": compute,
                "idle_handoff_ms": handoff - compute, "idle_host_ms": idle_ms - handoff,
                "stage_fwd_ms": mine["F"] * 1e3, **{k: v * 1e3 for k, v in {**backward, **split}.items()},
                "handoff_ms": self.handoff * 1e3,
                "stage_cost_ms": sum(stage_cost(self.costs, s, self.n, self.blocks(s)) for s in self.ids),
                "activation_bytes": self.saved.peak, "in_flight_micro_batches": self.peak_held,
                "comm_bytes": self.comm.metrics()["comm_bytes"], "send_count": self.comm.counts["send"]}

    def blocks(self, s: int) -> int:
        return self.bounds[s + 1] - self.bounds[s]

    def replay(self, handoff: float) -> tuple[float, list[float]]:
        """The live schedule's actions replayed on the calibration: wall (s), bubble per rank."""
        rank = rank_of(self.cfg.variant, world_size())
        return bubbles(replay_actions(self.orders, lambda s, k: self.times[(s, k)], handoff, rank))

    def replayed_idle(self, handoff: float) -> float:
        """This rank's idle ms in the replay with handoffs of `handoff` seconds."""
        wall, bubble = self.replay(handoff)
        return wall * bubble[self.rank] * 1e3

    def calibration(self) -> tuple[dict[tuple[int, str], float], float]:
        """Every module's seconds per micro-batch for F and B (or I and W), then one handoff: what
        the replay runs on. The ranks take turns, one run each per round while the others wait,
        so that a busy spell on a shared host falls on every rank's sample alike."""
        runs = []
        for _ in range(1 + CALIBRATION_REPEATS):  # the first round warms up
            for s in range(world_size()):
                dist.barrier()
                if s == self.rank:
                    runs.append({k: v for st in self.stages for k, v in self.time_module(st).items()})
        for stage in self.stages:
            stage.clear_runtime_states()
        self.modules.zero_grad(set_to_none=True)  # calibration's gradients reach no step
        # The median, not the fastest: the bubble is read from the fastest step, but a step sums
        # many ops, each about typical.
        own = {key: median(run[key] for run in runs[1:]) for key in runs[0]}
        every: list = [None] * world_size()
        dist.all_gather_object(every, own)
        dist.barrier()
        handoff = [self.time_handoff()]
        dist.broadcast_object_list(handoff, src=0)
        return {k: v for times in every for k, v in times.items()}, handoff[0]

    def time_module(self, stage: TimedStage) -> dict[tuple[int, str], float]:
        """Seconds of one module's forward (with the loss on the last and the sleep on a delayed
        rank) and its backward, full or as I then W, on one micro-batch, through the stage's own
        calls outside any schedule step (later modules: the last input received)."""
        mb, s = self.cfg.batch_size // self.cfg.micro_batches, stage.stage_index
        self.spans.steps.append([])
        out = stage.forward_one_chunk(0, (self.inputs[:mb],) if s == 0 else (),
                                      save_forward_output=False)
        loss = self.loss(out, self.targets[:mb]) if s == self.n - 1 else None
        stage.backward_one_chunk(0, loss=loss, full_backward=not self.split, last_backward=not self.split)
        if self.split:
            stage.backward_weight_one_chunk(0, last_backward=True)
        spans = [end - start for start, end, _ in self.spans.steps.pop()]
        k = 2 if self.split else 1
        backward = dict(zip("IW" if self.split else "B", spans[-k:]))
        return {(s, "F"): sum(spans[:-k]), **{(s, kind): t for kind, t in backward.items()}}

    def time_handoff(self) -> float:
        """Seconds from rank 0 sending one activation (b/m, T, d) to rank 1 holding it, awake (a
        gradient is the same size): half the median of HANDOFF_REPEATS round trips, each one send
        and one wake-up of a blocked receiver per direction, as in the schedule."""
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
        """The planner's parameters for this rank's modules; the bubble, busy time, wall and idle
        of the schedule's actions replayed on the calibration; the saved bytes of the same actions
        walked with the planner's bytes per micro-batch of each module; the in-flight formula."""
        cfg, r, p, m = self.cfg, self.rank, world_size(), self.cfg.micro_batches
        params = sum(planner.stage_params(replace(cfg.model, num_layers=self.blocks(s)),
                                          first=s == 0, last=s == self.n - 1).total * 4  # fp32
                     for s in self.ids)
        wall, bubble = self.replay(self.handoff)
        busy = m * sum(t for (s, _), t in self.times.items() if s in self.ids)
        return {"param_bytes": params, "optimizer_bytes": 2 * params,
                "bubble_fraction": bubble[r], "bubble_fraction_mean": sum(bubble) / p,
                "schedule_wall_ms": wall * 1e3, "stage_busy_ms": busy * 1e3,
                "idle_ms": wall * bubble[r] * 1e3,
                "activation_bytes": self.predicted_saved(),
                "in_flight_micro_batches": pipe_plan.in_flight_micro_batches(
                    cfg.variant, p, m, r, cfg.virtual_stages),
                "comm_bytes": pipe_plan.pipeline_sent_bytes(
                    cfg.variant, p, m, r, v=cfg.virtual_stages, batch_size=cfg.batch_size // m,
                    seq_len=cfg.seq_len, hidden_size=cfg.model.hidden_size),
                "send_count": m * pipe_plan.handoffs_per_micro_batch(cfg.variant, p, r, cfg.virtual_stages)}

    def predicted_saved(self) -> int:
        """Peak saved bytes of this rank: the schedule's actions walked at the planner's bytes per
        micro-batch of each module (the loss's share freed at a split backward's I), plus the
        batch's ids while a micro-batch viewing them is held (the first module's inputs, to
        their W; the last's targets, a one-row micro-batch's, to the I: they are the loss's)."""
        cfg, rows, last = self.cfg, self.cfg.batch_size // self.cfg.micro_batches, self.n - 1
        per_micro_batch = [pipe_plan.stage_activation_bytes(
            cfg.model, batch_size=rows, seq_len=cfg.seq_len, blocks=self.blocks(s),
            first=s == 0, last=s == last) for s in range(self.n)]
        loss = pipe_plan.loss_activation_bytes(cfg.model, batch_size=rows, seq_len=cfg.seq_len)
        sharing = ((0, "W"),) + (((last, "I"),) if rows == 1 else ())
        return in_flight(self.orders, per_micro_batch.__getitem__,
                         early=lambda s: loss if s == last else 0, sharing=sharing,
                         shared=pipe_plan.pipeline_token_bytes(cfg.batch_size, cfg.seq_len))[self.rank]


def timelines(cfg: Config) -> list[dict]:
    """Each schedule that runs at cfg's p and m, one step on equal modules and free handoffs
    (`labkit.blocks.pipeline_schedule.timeline`'s rows), for the notebook's figure."""
    p, v = num_stages(cfg), cfg.virtual_stages
    return [row for variant in SCHEDULES if skip_reason(replace(cfg, variant=variant)) is None
            for row in timeline(variant, p, cfg.micro_batches, v)]


def ideal_bubble(cfg: Config) -> float:
    return pipe_plan.ideal_bubble_fraction(cfg.variant, num_stages(cfg), cfg.micro_batches,
                                           stages_per_rank(cfg.variant, cfg.virtual_stages))


def build_pipeline(cfg: Config) -> Workload:
    pipe = Pipeline(cfg)
    return Workload(
        step=pipe.trainer.step, check=pipe.check, tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": pipe.modules.parameters,
                 "optimizer_bytes": pipe.trainer.optimizer_tensors},
        report=pipe.report, predicted=pipe.predicted, notes=notes(cfg, pipe),
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
    """The batch's loss, and this rank's modules' gradients against the same parameters' in the
    reference, after one step from the same weights and batch."""
    loss_diff = abs(outputs["loss"] - reference["loss"]) / abs(reference["loss"])
    stage = {"grads": {n: reference["grads"][n] for n in outputs["grads"]}}  # this rank's modules
    return compare_grads(stage, outputs, GRAD_TOLERANCE, extra={"loss_rel_diff": loss_diff},
                         limits={"loss_rel_diff": LOSS_TOLERANCE})


def expected(cfg: Config) -> dict[str, float]:
    if cfg.variant == REFERENCE:
        bytes_ = planner.param_bytes(cfg.model, cfg.dtype)
        return {"param_bytes": bytes_, "optimizer_bytes": 2 * bytes_}  # AdamW: two fp32 moments
    return {"ideal_bubble_fraction": ideal_bubble(cfg)}


def notes(cfg: Config, pipe: Pipeline) -> dict[str, str]:
    modules = []
    for s in pipe.ids:
        lo, hi = pipe.bounds[s], pipe.bounds[s + 1]
        parts = (["embedding"] if s == 0 else []) + ([f"blocks {lo}..{hi - 1}"] if hi > lo else [])
        parts += ["head + loss"] if s == pipe.n - 1 else []
        modules.append(f"module {s}: {' + '.join(parts)} "
                       f"({stage_cost(pipe.costs, s, pipe.n, hi - lo):.2f} ms)")
    measured = ", ".join(f"{k} {v:.2f} ms" for k, v in pipe.costs.items())
    sleep = (f" Rank {cfg.delay_stage} sleeps {cfg.stage_delay_ms:g} ms a micro-batch."
             if cfg.stage_delay_ms else "")
    sleep += (f" Every block sleeps {cfg.block_cost_ms:g} ms a micro-batch forward (stage_layers "
              f"{cfg.stage_layers or 'balanced'})." if cfg.block_cost_ms else "")
    return {"stage_cost_ms": f"{'; '.join(modules)}. Forward + backward per micro-batch on rank 0: "
                             f"{measured}.",
            "bubble_fraction": "1 - busy / wall in the fastest timed step. predicted: the live "
                               "schedule's action list replayed on each module's F, B (or I and "
                               "W) of a micro-batch and one handoff, timed alone after the timed "
                               "steps. idle_ms splits the measured idle time: idle_schedule_ms "
                               "(the replay with free handoffs: the schedule's shape and unequal "
                               "modules), idle_handoff_ms (what the handoffs add), idle_host_ms "
                               "(the rest: the schedule's host time between ops, wake-ups beyond "
                               "one handoff, other processes, see stall_fraction; below 0 where "
                               "the calibration's ops, timed alone, ran longer than the step's)."
                               f"{sleep}",
            "ideal_bubble_fraction": "equal modules, t_F = t_B(input) = t_W, free handoffs, as a "
                                     "fraction of the step (labkit.planner.pipeline).",
            "activation_bytes": "peak bytes saved for backward during the checked step. "
                                "predicted: the schedule's actions walked, each micro-batch held "
                                "from F to its B (or W), at the planner's bytes per micro-batch "
                                "of each module.",
            "in_flight_micro_batches": "peak micro-batches held for backward, counted per stage "
                                       "module (planner.pipeline.in_flight_micro_batches)."}
