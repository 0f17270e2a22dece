"""Data loading: a training loop fed by `torch.utils.data.DataLoader`, and the share of each step
spent waiting for the next batch.

Every step asks the loader for a batch (`next(iterator)`), copies it to the device, then trains
on it. With `num_workers=0` the main process builds the batch itself, so the step is data +
compute. With N worker processes each building whole batches ahead of time (`prefetch_factor`
batches each), the data work runs beside the compute and only what is not ready in time is
waited for: the step is about max(compute, data / N), when there are cores to spare.

- `baseline` (the reference): `num_workers=0`, pageable host memory, blocking copies.
- `pinned`: `pin_memory=True` (what page-locked memory changes: notebooks/text/23_dataloading.md).
- `non_blocking`: pinned, and `.to(device, non_blocking=True)`.
- `workers`: `num_workers` processes, `prefetch_factor` batches in flight per worker.
- `workers_pinned`: both.

On a CPU there is no host-to-device copy: pinning and non_blocking change nothing (the loader is
not asked to pin; the variants run, and say so), and `h2d_gbps` appears only on CUDA.

The data set is seeded and synthetic: sample i is `seq_len + 1` token ids drawn from a generator
seeded by (seed, i), so a sample is the same whichever process builds it, and the batches (same
seeded shuffle, made in the main process) are the same for every variant: identical losses.
Preprocessing cost is real CPU work, not sleep: `sample_cost_us` of integer hashing per sample
(numpy; calibrated once per process to a number of rounds), whose result travels with the batch
as a checksum. Real work competes for the cores with the training thread, which is the point on
a 2-core machine; `io_latency_us` adds a sleep per sample, named for what it models: waiting on
storage, which frees the core.

Workers start by `start_method`: `forkserver` (default) forks each worker from a clean server
process that imported labkit once, so starting is cheap after the first time and no worker
inherits the parent's threads or the harness's dispatch modes (a plain `fork` after torch has
started OpenMP and autograd threads is not safe in general); `spawn` imports torch again in every
worker (seconds each); `fork` is the Linux default, kept to compare. Startup shows in
`first_batch_ms`; `persistent_workers` keeps workers across epochs.
"""
from __future__ import annotations

import contextlib
import functools
import math
import multiprocessing
import statistics
import time
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from labkit import hardware, planner
from labkit.config import ConfigError, RunConfig, knob
from labkit.measure.clock import CudaSpan, clock
from labkit.measure.modes import is_metered
from labkit.measure.pace import mean_seconds
from labkit.blocks.training import Trainer
from labkit.workload import Comparison, Workload

VARIANTS = ("baseline", "pinned", "non_blocking", "workers", "workers_pinned")
REFERENCE = "baseline"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"steps": 2, "batch_size": 2, "seq_len": 32},
             {"steps": 2, "batch_size": 2, "seq_len": 32, "num_layers": 2, "sample_cost_us": 5000.0,
              "epoch_steps": 50})

START_METHODS = ("forkserver", "spawn", "fork")
PINNED = ("pinned", "non_blocking", "workers_pinned")
WORKERS = ("workers", "workers_pinned")


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="how the loader feeds the step")
    steps: int = knob(4, min=1, help="training steps compared with the reference")
    lr: float = knob(1e-3, min=0.0, help="AdamW learning rate")
    sample_cost_us: float = knob(20000.0, min=0.0, help="real CPU work per sample (hashing), µs")
    io_latency_us: float = knob(0.0, min=0.0, help="sleep per sample (models storage latency), µs")
    num_workers: int = knob(2, min=1, help="worker processes (workers variants)")
    prefetch_factor: int = knob(2, min=1, help="batches in flight per worker")
    persistent_workers: bool = knob(True, help="keep workers alive across epochs")
    start_method: str = knob("forkserver", choices=START_METHODS, help="how workers start")
    epoch_steps: int = knob(1000, min=1, help="batches per epoch (a new epoch refills the pipeline)")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"dataloading trains in float32 (got {cfg.dtype}); valid: float32")
    if cfg.epoch_steps < cfg.steps:
        raise ConfigError(f"epoch_steps={cfg.epoch_steps} must be >= steps={cfg.steps}: the "
                          "compared steps are one epoch's first batches")


# ---------------------------------------------------------------- the data set
HASH_MUL, HASH_INC = np.uint64(6364136223846793005), np.uint64(1442695040888963407)
_ROUND_US: dict[int, float] = {}  # per-round cost by sample length, measured once per process


def hash_rounds(x: np.ndarray, rounds: int) -> int:
    """`rounds` of a 64-bit multiply-xorshift over x (uint64, wrapping): real CPU work."""
    for _ in range(rounds):
        x = x * HASH_MUL + HASH_INC
        x ^= x >> np.uint64(29)
    return int(x[0] & np.uint64(0x7FFFFFFF)) if rounds else 0


def round_us(length: int) -> float:
    """µs per hashing round over `length` elements on this machine as it runs now (cached): the
    mean over a span (`pace.mean_seconds`), so a CPU quota's or a neighbour's share of the time
    counts as it will while the loader works; the best of a few calls would catch a burst at full
    speed, and a sample stated to cost 50 ms then took 3.7 times that under a 0.4-core quota."""
    if length not in _ROUND_US:
        x = np.arange(length, dtype=np.uint64)
        _ROUND_US[length] = mean_seconds(lambda: hash_rounds(x, 50)) / 50 * 1e6
    return _ROUND_US[length]


class SyntheticTokens(Dataset):
    """`num_samples` sequences of `length` token ids; sample i depends only on (seed, i)."""

    def __init__(self, num_samples: int, length: int, vocab_size: int, seed: int, rounds: int,
                 io_latency_s: float):
        self.num_samples, self.length, self.vocab_size = num_samples, length, vocab_size
        self.seed, self.rounds, self.io_latency_s = seed, rounds, io_latency_s

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        if self.io_latency_s:
            time.sleep(self.io_latency_s)
        rng = np.random.default_rng([self.seed, i])  # per sample: the same in any process
        tokens = rng.integers(0, self.vocab_size, self.length, dtype=np.int64)
        checksum = hash_rounds(tokens.astype(np.uint64), self.rounds)
        return {"tokens": torch.from_numpy(tokens), "checksum": checksum}


def make_dataset(cfg: Config) -> SyntheticTokens:
    length = cfg.seq_len + 1
    rounds = round(cfg.sample_cost_us / round_us(length)) if cfg.sample_cost_us else 0
    return SyntheticTokens(cfg.epoch_steps * cfg.batch_size, length, cfg.model.vocab_size,
                           cfg.seed, rounds, cfg.io_latency_us / 1e6)


def worker_context(method: str):
    """The multiprocessing context the workers start from (see the module docstring)."""
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":  # import torch and labkit once, in the server, not per worker
        ctx.set_forkserver_preload([__name__])
    return ctx


def make_loader(cfg: Config, dataset: Dataset) -> DataLoader:
    """The variant's loader. The shuffle is drawn in the main process from a seeded generator, so
    the order is the same with or without workers; samples need no per-worker seed (each is seeded
    by its index), and the generator also fixes the workers' base seed."""
    kw = {}
    if cfg.variant in WORKERS:
        kw = dict(num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
                  persistent_workers=cfg.persistent_workers,
                  multiprocessing_context=worker_context(cfg.start_method))
    return DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True,
                      generator=torch.Generator().manual_seed(cfg.seed),
                      pin_memory=cfg.variant in PINNED and is_cuda(cfg), **kw)


def is_cuda(cfg: Config) -> bool:
    return cfg.device.startswith("cuda")


# ---------------------------------------------------------------- the training loop
class LoaderFeed:
    """The plain training step's data source and meter (`Trainer.batches`, `Trainer.phase`): each
    step waits for the loader's next batch and copies it to the device (the `data` phase); the
    seconds of that wait, of the whole step and of the copy are recorded per step."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.loader = make_loader(cfg, make_dataset(cfg))
        self.iterator = None
        self.non_blocking = cfg.variant == "non_blocking"
        self.records: list[tuple[float, float, float]] = []  # (wait_s, step_s, copy_s) per step
        self.batches: list[dict] = []  # host copies of the batches check() trained on
        self.first_batch_s = math.nan
        self.started = self.waited = self.copy_s = 0.0

    def next_batch(self) -> dict:
        """The next batch; a new epoch (a fresh pipeline) when this one is used up."""
        if self.iterator is not None:
            batch = next(self.iterator, None)
            if batch is not None:
                return batch
        start = clock(self.cfg.device)
        self.iterator = iter(self.loader)  # starts the workers (or reuses persistent ones)
        batch = next(self.iterator)
        if math.isnan(self.first_batch_s):
            self.first_batch_s = clock(self.cfg.device) - start
        return batch

    def __call__(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's (inputs, targets) on the device, from the loader's next batch."""
        cuda = is_cuda(self.cfg)
        batch = self.next_batch()
        self.waited = clock(self.cfg.device) - self.started
        copy = CudaSpan() if cuda else contextlib.nullcontext()
        with copy:
            tokens = batch["tokens"].to(self.cfg.device, non_blocking=self.non_blocking)  # (B, T+1)
        if not cuda:
            self.waited = clock(self.cfg.device) - self.started
        self.copy_s = copy.seconds if cuda else 0.0
        if len(self.batches) < self.cfg.steps:
            self.batches.append(batch)
        return tokens[:, :-1], tokens[:, 1:]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        # Host seconds on the one clock (on CUDA it drains the device first: nothing of this
        # step is queued yet); the copy by CUDA events: a non_blocking copy returns before it ends.
        if name == "data":
            self.started = clock(self.cfg.device)
        yield
        if name != "optimizer":
            return
        # On CUDA the compute stream waits for the copy whether or not the host did: count it.
        self.records.append((self.waited + self.copy_s, clock(self.cfg.device) - self.started,
                             self.copy_s))
        if is_metered():  # a harness meter (memory, FLOPs) slowed this step: not a timing
            self.records.pop()

    def medians(self) -> tuple[float, float]:
        """The median step's wait and compute, in seconds: one step stalled by something else on
        the machine (a preempted or throttled process) moves neither."""
        return (statistics.median(w for w, _, _ in self.records),
                statistics.median(t - w for w, t, _ in self.records))

    def report(self) -> dict[str, float]:
        if not self.records:
            return {"first_batch_ms": self.first_batch_s * 1e3}
        wait, compute = self.medians()
        copy = sum(c for _, _, c in self.records)
        out = {"data_wait_pct": 100 * wait / (wait + compute), "data_ms": 1e3 * wait,
               "compute_ms": 1e3 * compute, "first_batch_ms": self.first_batch_s * 1e3}
        if is_cuda(self.cfg) and copy > 0:
            out["h2d_gbps"] = batch_bytes(self.cfg) * len(self.records) / copy / 1e9
        return out

    def predicted(self) -> dict[str, float]:
        """step ≈ data + compute without workers, max(compute, data / workers) with them, from
        this run's measured compute time and the data set's per-sample cost."""
        if not self.records:
            return {}
        compute_ms = 1e3 * self.medians()[1]
        data = data_ms(self.cfg)
        step = max(compute_ms, data / self.cfg.num_workers) if self.cfg.variant in WORKERS \
            else compute_ms + data
        return {"step_ms": step, "data_wait_pct": 100 * (step - compute_ms) / step}


def batch_bytes(cfg: Config) -> int:
    return cfg.batch_size * (cfg.seq_len + 1) * 8  # int64 token ids


def data_ms(cfg: Config) -> float:
    """The napkin cost of building one batch: per-sample work and latency, times the batch."""
    return cfg.batch_size * (cfg.sample_cost_us + cfg.io_latency_us) / 1e3


def build(cfg: Config) -> Workload:
    trainer, feed = Trainer(cfg, lr=cfg.lr), LoaderFeed(cfg)
    trainer.batches, trainer.phase = feed, feed.phase
    return Workload(
        step=trainer.step, check=functools.partial(check, trainer, feed),
        tokens_per_step=cfg.batch_size * cfg.seq_len, tensors={"param_bytes": trainer.model.parameters},
        report=feed.report, predicted=feed.predicted, notes=notes(cfg), compute_dtype=cfg.dtype,
        min_repeats=5)  # the median of 5 steps: two stalled steps cannot decide the wait


def check(trainer: Trainer, feed: LoaderFeed) -> dict:
    """`steps` steps from a fresh loader: losses, and the batches trained on."""
    trainer.train(feed.cfg.steps)
    feed.records.clear()  # the pipeline's start is reported as first_batch_ms instead
    return {"losses": list(trainer.losses), "tokens": [b["tokens"] for b in feed.batches],
            "checksums": [b["checksum"] for b in feed.batches]}


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """The same batches in the same order, so the same losses, exactly: loading changes the
    time, never what is trained on."""
    same_batches = len(reference["tokens"]) == len(outputs["tokens"]) and all(
        torch.equal(a, b) for a, b in zip(reference["tokens"], outputs["tokens"])) and all(
        torch.equal(a, b) for a, b in zip(reference["checksums"], outputs["checksums"]))
    ref, got = reference["losses"], outputs["losses"]
    delta = max(abs(a - b) for a, b in zip(ref, got))
    ok = same_batches and delta == 0.0
    message = "" if ok else ("the batches differ from the reference's" if not same_batches
                             else f"losses differ by up to {delta:.3g}")
    return Comparison({"loss": got[-1], "loss_delta": delta, "batches_match": float(same_batches)},
                      ok, message)


def expected(cfg: Config) -> dict[str, float]:
    """Compute at the device's peak (the datasheet's, or the CPU's physical ceiling) and the
    data cost from the knobs; `predicted()` refines step_ms with the measured compute."""
    flops = planner.train_step_flops(cfg.model, batch=cfg.batch_size, seq_len=cfg.seq_len,
                                     attention=cfg.attention)
    out = {"flops": flops, "loss_delta": 0.0, "batches_match": 1.0,
           "param_bytes": planner.param_bytes(cfg.model, "float32")}
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get("float32")
    if peak:
        compute = flops / (peak * 1e12) * 1e3
        data = data_ms(cfg)
        out["compute_ms"] = compute
        out["data_ms"] = data
        if cfg.variant in WORKERS:
            out["data_ms"] = max(0.0, data / cfg.num_workers - compute)  # what is left to wait
    return out


def notes(cfg: Config) -> dict[str, str]:
    out = {"data_wait_pct": "time blocked in next(iterator) plus the host-to-device copy, over "
                            "the step's time (perf_counter; on CUDA the copy is timed by events): the "
                            "median step's wait over that wait plus the median step's compute, "
                            "so one step stalled by other work on the machine does not decide it.",
           "step_ms": "predicted: data + compute without workers, max(compute, data / workers) "
                      "with them, from this run's measured compute and the per-sample cost "
                      "knobs; assumes a free core per worker.",
           "compute_ms": "forward, backward and optimizer step: the step less the data wait. "
                         "Workers on too few cores take CPU time from it.",
           "first_batch_ms": "from iter(loader) to the first batch: worker startup (start_method) "
                             "plus one batch's work."}
    if not is_cuda(cfg) and cfg.variant in PINNED:
        out["step_ms"] = ("on a CPU there is no host-to-device copy: pinned memory and "
                          "non_blocking change nothing here (the loader is not asked to pin). "
                          + out["step_ms"])
    cores = hardware.cpu_info().num_cores
    if cfg.variant in WORKERS and cores <= cfg.num_workers:
        out["data_wait_pct"] += (f" {cfg.num_workers} workers on {cores} cores compete with the "
                                 "training thread for CPU time.")
    return out
