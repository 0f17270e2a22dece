"""Load balance in data parallelism: unequal devices sharing one global batch.

Data parallelism waits for its slowest rank at every gradient all-reduce, so with unequal devices
an even split runs at the slow device's pace. On the CPU one rank (`slow_rank`) is made slower on
purpose: after its forward and backward it sleeps (slowdown - 1) x the time they took, every
step, before it joins the all-reduce, as a device `slowdown` times slower would arrive late. On
GPUs of different models, slowdown 1 lets the devices' own speeds show.

- `even` (the reference): the global batch of G = n x b sequences in n equal shares.
- `proportional`: each rank times a few forward+backward passes of b sequences (the calibration),
  the speeds are all-gathered, and the G sequences are split in proportion (whole sequences, at
  least one each). The predicted step is max_i(share_i / speed_i) for either split.

Every rank weights its mean loss by share_i / G, and the gradients are summed by one all-reduce
of all of them after the backward (DDP with one bucket and no overlap, by hand, so the delay sits
between the compute and the collective): sum_i share_i/G x mean_i = the global batch's mean, so
both splits give the one-process gradient of all G sequences, up to fp32 rounding (checked).
"""
from __future__ import annotations

import contextlib
import functools
import math
import statistics
import time
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from labkit import planner
from labkit.config import ConfigError, knob
from labkit.blocks.distributed import DistConfig, rank, release_buffers, world_size
from labkit.measure.clock import clock
from labkit.blocks.training import Trainer, compare_grads
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("even", "proportional")
REFERENCE = "even"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3, "seq_len": 32}, {"timed_steps": 2, "seq_len": 32, "num_layers": 2},
             {"timed_steps": 2, "seq_len": 32, "num_layers": 1})

TOLERANCE = 1e-5  # normwise relative gradient difference: fp32 sums in another order


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="even shares, or shares proportional to speed")
    slow_rank: int = knob(1, min=0, help="the rank made slower")
    slowdown: float = knob(2.0, min=1.0, help="how many times slower slow_rank computes; 1: the "
                                              "devices' own speeds")
    calibration_steps: int = knob(3, min=1, help="timed forward+backward passes that measure "
                                                 "each rank's speed")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"load_balance trains in float32 (got {cfg.dtype})")
    if cfg.nproc is not None and cfg.slow_rank >= cfg.nproc:
        raise ConfigError(f"slow_rank={cfg.slow_rank} but there are {cfg.nproc} ranks; valid: "
                          f"0..{cfg.nproc - 1}")


def split(total: int, speeds: list[float]) -> list[int]:
    """Whole sequences in proportion to `speeds`, summing to `total`, at least one each
    (largest remainder: the floors first, then one more to the largest fractional parts)."""
    exact = [total * s / sum(speeds) for s in speeds]
    shares = [max(1, math.floor(x)) for x in exact]
    while sum(shares) > total:  # only when the floor of 1 pushed it over: take from a share > 1
        shares[max((i for i in range(len(shares)) if shares[i] > 1),
                   key=lambda i: shares[i] - exact[i])] -= 1
    for i in sorted(range(len(shares)), key=lambda i: shares[i] - exact[i])[:total - sum(shares)]:
        shares[i] += 1
    return shares


def predicted_step_s(shares: list[int], speeds: list[float]) -> float:
    """The all-reduce waits for the last rank: max_i(share_i / speed_i), compute only."""
    return max(share / speed for share, speed in zip(shares, speeds))


class RankClock:
    """A meter around this rank's phases of the step (`Trainer.phase`): each step's forward and
    backward seconds (`compute_s`), on the slow rank stretched by a sleep of `delay` x what they
    took, as a device that much slower would arrive late; and the seconds of the gradients' sum
    (`wait_s`, in `reduce`: the wait for the slowest rank, then the transfer)."""

    def __init__(self, device: str, delay: float):
        self.device, self.delay = device, delay
        self.compute_s: list[float] = []
        self.wait_s: list[float] = []
        self.started = 0.0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name == "forward":
            self.started = clock(self.device)
        yield
        if name == "backward":
            time.sleep(self.delay * (clock(self.device) - self.started))
            self.compute_s.append(clock(self.device) - self.started)

    def reduce(self, trainer: Trainer) -> None:
        """One all-reduce (sum) of every gradient, flattened into one fp32 buffer."""
        start = clock(self.device)
        params = list(trainer.model.parameters())
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        release_buffers((flat,))  # gloo's worker may hold it a moment longer: not into the step
        self.wait_s.append(clock(self.device) - start)


@dataclass
class Split:
    """The global batch of `total` sequences in `shares` by rank, from the calibrated `speeds`
    (sequences per second by rank, the same list on every rank)."""

    total: int
    speeds: list[float]
    shares: list[int]


def build_step(cfg: Config) -> tuple[Trainer, RankClock, Split]:
    """The plain training step over the global batch (the same on every rank), calibrated, then
    cut to this rank's share: its mean loss weighted by share / G, the gradients summed by hand
    after the backward (`RankClock.reduce`), no gradient norm."""
    n, r = world_size(), rank()
    if cfg.slow_rank >= n:  # the same on every rank: all raise together
        raise ConfigError(f"slow_rank={cfg.slow_rank} but there are {n} ranks; valid: 0..{n - 1}")
    total = n * cfg.batch_size  # G
    trainer = Trainer(cfg, batch_size=total)  # (G, T), the same on every rank
    meter = RankClock(cfg.device, cfg.slowdown - 1 if r == cfg.slow_rank else 0.0)
    trainer.phase, trainer.measure_norm = meter.phase, False
    speeds = calibrate(trainer, meter)
    shares = split(total, speeds) if cfg.variant == "proportional" else [cfg.batch_size] * n
    mine = slice(sum(shares[:r]), sum(shares[:r + 1]))
    trainer.inputs, trainer.targets = trainer.inputs[mine], trainer.targets[mine]  # (share_r, T)
    trainer.sizes, trainer.loss_weight = [shares[r]], shares[r] / total
    trainer.reduce_grads = meter.reduce
    return trainer, meter, Split(total, speeds, shares)


def calibrate(trainer: Trainer, meter: RankClock) -> list[float]:
    """Every rank's sequences per second on b sequences (forward and backward, no sum),
    all-gathered (the same list on every rank, so every rank computes the same split)."""
    cfg, b = trainer.cfg, trainer.cfg.batch_size
    whole = trainer.inputs, trainer.targets
    trainer.inputs, trainer.targets, trainer.sizes = whole[0][:b], whole[1][:b], [b]
    for _ in range(cfg.calibration_steps):
        trainer.accumulate(sync=False)
        trainer.drop_grads()
    trainer.inputs, trainer.targets = whole
    speeds: list = [None] * world_size()
    dist.all_gather_object(speeds, b / statistics.median(meter.compute_s[-cfg.calibration_steps:]))
    return speeds


def check(trainer: Trainer) -> dict:
    """One step: the global batch's mean loss and the summed gradients it applied."""
    loss = torch.tensor(trainer.accumulate() * trainer.loss_weight, dtype=torch.float64)
    dist.all_reduce(loss)  # sum_i share_i/G x mean_i: the global mean
    grads = {n: p.grad.detach().cpu().numpy().copy() for n, p in trainer.model.named_parameters()}
    trainer.update()
    return {"loss": loss.item(), "grads": grads}


def report(cfg: Config, meter: RankClock, at: Split) -> dict[str, float]:
    timed = cfg.timed_steps  # the last steps are the harness's timed ones
    return {"num_sequences": float(at.shares[rank()]), "sequences_per_s": at.speeds[rank()],
            "compute_ms": statistics.median(meter.compute_s[-timed:]) * 1e3,
            "wait_ms": statistics.median(meter.wait_s[-timed:]) * 1e3}


def predicted(cfg: Config, at: Split) -> dict[str, float]:
    """From the calibrated speeds: this split's step, and this rank's compute and wait."""
    r = rank()
    step_s = predicted_step_s(at.shares, at.speeds)
    compute_s = at.shares[r] / at.speeds[r]
    plan = planner.training_memory(cfg.model, batch_size=at.shares[r], seq_len=cfg.seq_len,
                                   precision="fp32", optimizer="adamw", device=cfg.device)
    # after the backward, the hand-written all-reduce (`RankClock.reduce`) holds every gradient
    # twice: as the parameters' .grad and flattened into its one buffer
    reduce = plan.param_bytes + 2 * plan.grad_bytes + plan.optimizer_bytes
    return {"step_ms": step_s * 1e3, "compute_ms": compute_s * 1e3,
            "wait_ms": (step_s - compute_s) * 1e3, "sequences_per_s": at.speeds[r],
            "num_sequences": at.total * at.speeds[r] / sum(at.speeds)
            if cfg.variant == "proportional" else float(cfg.batch_size),
            "peak_mem_bytes": max(plan.total_bytes, reduce)}


def build(cfg: Config) -> Workload:
    trainer, meter, at = build_step(cfg)
    return Workload(
        step=trainer.step, check=functools.partial(check, trainer),
        tokens_per_step=at.shares[rank()] * cfg.seq_len,
        tensors={"param_bytes": trainer.model.parameters, "optimizer_bytes": trainer.optimizer_tensors},
        report=functools.partial(report, cfg, meter, at), predicted=functools.partial(predicted, cfg, at),
        notes=notes(cfg, at), count_flops=False, compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """One step from the same weights on the same global batch: loss and every gradient."""
    loss_rel = abs(outputs["loss"] - reference["loss"]) / abs(reference["loss"])
    return compare_grads(reference, outputs, TOLERANCE, extra={"loss_rel_diff": loss_rel})


def expected(cfg: Config) -> dict[str, float]:
    plan = planner.training_memory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                   precision="fp32", optimizer="adamw", device=cfg.device)
    return {"param_bytes": plan.param_bytes, "optimizer_bytes": plan.optimizer_bytes}


def notes(cfg: Config, at: Split) -> dict[str, str]:
    even = [cfg.batch_size] * len(at.speeds)
    proportional = split(at.total, at.speeds)
    speeds = ", ".join(f"{s:.1f}" for s in at.speeds)
    return {
        "step_ms": (f"predicted: max over ranks of share / speed, compute only. Calibrated speeds "
                    f"(sequences/s by rank): {speeds}; from them even {even} would take "
                    f"{predicted_step_s(even, at.speeds) * 1e3:.1f} ms, proportional "
                    f"{proportional} {predicted_step_s(proportional, at.speeds) * 1e3:.1f} ms."),
        "compute_ms": (f"this rank's forward + backward on its share, the slow rank's sleep "
                       f"included (slowdown {cfg.slowdown:g} on rank {cfg.slow_rank})."),
        "wait_ms": "in the all-reduce: waiting for slower ranks, then the transfer.",
        "peak_mem_bytes": ("predicted: the larger of the planner's one-process step on this "
                           "rank's share and the all-reduce after the backward (weights, the "
                           "gradients and their flat copy, AdamW's moments: 20 bytes a "
                           "parameter), which a small share leaves as the peak."),
        "num_sequences": ("this rank's share of the global batch; predicted for proportional: "
                          "the exact share G x speed / sum of speeds, before rounding."),
    }
