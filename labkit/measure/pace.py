"""How fast this CPU runs labkit's kind of work, measured in about a second, so that sizes come
from a seconds target and not from constants tuned on one machine.

Two CPUs with the same core count differ by 5x on the same fp32 work (clock, vector width, a
busy neighbour), and by another 15-70x on bf16 and fp16 matmuls where they have no native
instructions. So the pace is two measurements:

- `step_s`: one small training step in plain torch (embedding, two MLP blocks with LayerNorm,
  attention, cross-entropy, an SGD update; about as much dispatch overhead as FLOPs, like
  labkit's CPU runs), its mean over at least `MIN_SPAN_S`, so a CPU quota or a neighbour that
  takes the core part of the time is seen, not a lucky burst (the best of three such spans);
- `gflops`: a matmul's GFLOP/s per dtype at one thread, over the same kind of span.

`slowdown` is this CPU's `step_s` over the reference CPU's (`REFERENCE`, where labkit's costs were
measured): the factor every measured cost is multiplied by. `LABKIT_RATE_SCALE` multiplies the
rates (0.2: a CPU five times slower), for checking the sizing without such a CPU; `LABKIT_PACE`
holds a pace measured once, as JSON, which `measure_pace` then takes instead of measuring (a
parent can hand its measurement to the processes it starts; the tests give a pace so).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

MIN_SPAN_S = 0.25  # each span runs at least this long: over two 100 ms scheduler (quota) periods
WARMUP = 3
SCALE_ENV, PACE_ENV = "LABKIT_RATE_SCALE", "LABKIT_PACE"
DTYPES = {"float32": 512, "bfloat16": 128, "float16": 128}  # matmul size per dtype: an emulated
# 16-bit matmul is 15-70x slower, so its size is small


@dataclass(frozen=True)
class Pace:
    """Seconds of the reference step and matmul GFLOP/s per dtype, at one thread."""

    step_s: float
    gflops: dict[str, float] = field(default_factory=dict)
    scale: float = 1.0  # LABKIT_RATE_SCALE, already applied to step_s and gflops
    source: str = ""

    @property
    def slowdown(self) -> float:
        """How many times the reference CPU's seconds this CPU takes for the same work."""
        return self.step_s / REFERENCE.step_s

    @property
    def measured_slowdown(self) -> float:
        """The slowdown this CPU really had, LABKIT_RATE_SCALE taken back out: what turns seconds
        measured here into the reference CPU's."""
        return self.slowdown * self.scale

    def rate(self, dtype: str) -> float:
        """Matmul FLOP/s in `dtype` (fp32's when that dtype was not measured)."""
        return 1e9 * self.gflops.get(dtype, self.gflops["float32"])

    def describe(self) -> str:
        rates = ", ".join(f"{d} {g:.3g}" for d, g in self.gflops.items())
        scaled = f", rates scaled by {self.scale:g} ({SCALE_ENV})" if self.scale != 1 else ""
        return (f"{self.slowdown:.2f}x the reference CPU's seconds (step {1e3 * self.step_s:.2f} ms; "
                f"matmul GFLOP/s {rates}{scaled})")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


# Measured on the CPU labkit's costs were measured on (`labkit.harness.budget`), one thread.
REFERENCE = Pace(step_s=0.0032, gflops={"float32": 90.0, "bfloat16": 110.0, "float16": 3.5},
                 source="AMD EPYC (Zen 4, family 25 model 17: avx512_bf16, no avx512_fp16), "
                        "2 cores under KVM, torch 2.13.0+cpu")


def rate_scale() -> float:
    """LABKIT_RATE_SCALE as a number > 0 (1 when unset); a clear error otherwise."""
    text = os.environ.get(SCALE_ENV, "").strip()
    try:
        scale = float(text) if text else 1.0
    except ValueError:
        scale = -1.0
    if not scale > 0:
        raise ValueError(f"{SCALE_ENV}={text!r}: a number above 0 (1: this CPU as it is; 0.2: "
                         "five times slower)")
    return scale


@functools.lru_cache(maxsize=None)
def measure_pace() -> Pace:
    """This CPU's pace, once per process: from LABKIT_PACE when set, else `measure_now()`."""
    given = os.environ.get(PACE_ENV)
    return Pace(**json.loads(given)) if given else measure_now()


@contextlib.contextmanager
def handed_down() -> Iterator[None]:
    """Within the block, the processes this one starts take its pace (LABKIT_PACE) instead of
    each measuring it again (a report's notebook kernels: about 1.5 s of the reference CPU's
    each); a pace already given stands."""
    given = os.environ.get(PACE_ENV)
    os.environ[PACE_ENV] = given or measure_pace().to_json()
    try:
        yield
    finally:
        if given is None:
            del os.environ[PACE_ENV]


def measure_now() -> Pace:
    """The pace measured now (about a second, one thread), LABKIT_RATE_SCALE applied on top."""
    scale = rate_scale()
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step_s = mean_seconds(_reference_step(), spans=3)
        gflops = {d: 2 * n**3 / mean_seconds(_matmul(n, getattr(torch, d))) / 1e9
                  for d, n in DTYPES.items()}
    finally:
        torch.set_num_threads(previous)
    return Pace(step_s / scale, {d: g * scale for d, g in gflops.items()}, scale,
                "measured in this process")


def mean_seconds(fn, spans: int = 1) -> float:
    """Seconds of one call of `fn`: the mean over a span of at least MIN_SPAN_S (a mean, so a
    quota's pauses count), the best of `spans` such spans (a moment's stall elsewhere does not),
    after WARMUP untimed calls."""
    for _ in range(WARMUP):
        fn()
    means = []
    for _ in range(spans):
        calls, t0 = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - t0) < MIN_SPAN_S or calls < 2:
            fn()
            calls += 1
        means.append(elapsed / calls)
    return min(means)


def _matmul(n: int, dtype: torch.dtype):
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return lambda: torch.mm(a, b)


def _reference_step():
    """One training step of a small model in plain torch: tokens (2 x 32), width 128, vocab 512."""
    gen = torch.Generator().manual_seed(0)
    nn = torch.nn
    width, vocab = 128, 512
    embed, head = nn.Embedding(vocab, width), nn.Linear(width, vocab)
    blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                         nn.Linear(4 * width, width)) for _ in range(2))
    params = [p for m in (embed, head, blocks) for p in m.parameters()]
    tokens = torch.randint(0, vocab, (2, 33), generator=gen)

    def step():
        x = embed(tokens[:, :-1])  # (B, T, C)
        for block in blocks:
            q = x.view(2, 32, 4, 32).transpose(1, 2)  # (B, heads, T, head_dim)
            x = x + torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True) \
                .transpose(1, 2).reshape(2, 32, width)
            x = x + block(x)
        loss = torch.nn.functional.cross_entropy(head(x).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        with torch.no_grad():  # an SGD update by hand: torch.optim's first import costs a second
            for p in params:
                p.add_(p.grad, alpha=-1e-3)
                p.grad = None
    return step
