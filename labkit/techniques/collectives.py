"""Collectives: all-reduce, all-gather and reduce-scatter across message sizes, on torch.distributed.

Each variant is checked first: every rank fills its buffer with values that depend on its rank, and
the result must equal the sum (or the concatenation) computed locally from the formula. Timing
then runs the collective on a zero buffer (sums of zeros stay finite however many repeats).

Bandwidth as nccl-tests reports it (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md):
`algbw_gbps` = S / t, where S is the all-reduce's buffer, or the all-gather's output (the
reduce-scatter's input); `busbw_gbps` = algbw x a factor, 2(n-1)/n for all-reduce and (n-1)/n for
the other two, the bytes each rank must move on its busiest link with a ring algorithm, so it
compares across world sizes and against the link's own bandwidth.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labkit.config import ConfigError, knob, torch_dtype
from labkit.blocks.distributed import DistConfig, link_gbps, world_size
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("all_reduce", "all_gather", "reduce_scatter")
REFERENCE = "all_reduce"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3}, {"timed_steps": 2, "message_bytes": 65536})

NCCL_SETTINGS = ("NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_MAX_NCHANNELS")
TOLERANCE = 1e-6  # small integers summed in fp32: exact


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="the collective")
    message_bytes: int = knob(2**20, min=4, help="S: the all-reduce buffer, the all-gather's "
                                                 "output, the reduce-scatter's input")
    nccl_algo: str = knob("", help="NCCL_ALGO for this point (GPUs): Ring, Tree, ...; empty: NCCL's choice")
    nccl_proto: str = knob("", help="NCCL_PROTO for this point (GPUs): LL, LL128, Simple")
    nccl_channels: int = knob(0, min=0, help="NCCL_MIN/MAX_NCHANNELS for this point (GPUs); 0: NCCL's choice")
    uses_seq_len = False


def validate(cfg: Config) -> None:
    nccl = cfg.nccl_algo or cfg.nccl_proto or cfg.nccl_channels
    if nccl and not cfg.device.startswith("cuda"):
        raise ConfigError("nccl_algo, nccl_proto and nccl_channels are NCCL settings: they apply "
                          "on GPUs; CPU ranks use gloo")


def bus_factor(variant: str, n: int) -> float:
    return 2 * (n - 1) / n if variant == "all_reduce" else (n - 1) / n


def nccl_env(cfg: Config) -> dict[str, str]:
    """The NCCL settings this point asks for (a new communicator reads them when it starts)."""
    env = {"NCCL_ALGO": cfg.nccl_algo, "NCCL_PROTO": cfg.nccl_proto}
    if cfg.nccl_channels:
        env.update(NCCL_MIN_NCHANNELS=str(cfg.nccl_channels), NCCL_MAX_NCHANNELS=str(cfg.nccl_channels))
    return {k: v for k, v in env.items() if v}


_GROUPS: dict[tuple, object] = {}  # one communicator per combination of NCCL settings
# What the default group's communicator started with (this module is imported in the rank, after
# the group was made, before any point changes the environment).
_DEFAULT_NCCL = {k: os.environ.get(k, "") for k in NCCL_SETTINGS}


def make_group(cfg: Config):
    """The default group, or, for NCCL settings, a group made with them in the environment (a
    communicator reads them when it starts); every rank calls this at the same point."""
    settings = nccl_env(cfg)
    if not settings or not cfg.device.startswith("cuda"):
        return None
    key = tuple(sorted(settings.items()))
    if key not in _GROUPS:
        for name in NCCL_SETTINGS:
            os.environ.pop(name, None)
        os.environ.update(settings)
        _GROUPS[key] = dist.new_group(backend="nccl")
    return _GROUPS[key]


def buffers(cfg: Config, n: int, fill: float) -> tuple[torch.Tensor, torch.Tensor | list]:
    """(input, output) of S bytes in all: the all-gather's output and the reduce-scatter's input
    are S, split in n equal pieces."""
    dtype = torch_dtype(cfg.dtype)
    elems = max(n, cfg.message_bytes // dtype.itemsize // n * n)  # divisible by n
    if cfg.variant == "all_reduce":
        x = torch.full((elems,), fill, dtype=dtype, device=cfg.device)
        return x, x
    if cfg.variant == "all_gather":
        return (torch.full((elems // n,), fill, dtype=dtype, device=cfg.device),
                torch.empty(elems, dtype=dtype, device=cfg.device))
    return (torch.full((elems,), fill, dtype=dtype, device=cfg.device),
            torch.empty(elems // n, dtype=dtype, device=cfg.device))


# torch 2.13 renamed the tensor forms (`*_single`) and deprecates the old names, which 2.6 needs.
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def call(variant: str, inp: torch.Tensor, out: torch.Tensor, group) -> None:
    if variant == "all_reduce":
        dist.all_reduce(inp, group=group)
    elif variant == "all_gather":
        ALL_GATHER(out, inp, group=group)
    else:
        REDUCE_SCATTER(out, inp, group=group)


def expected_result(variant: str, n: int, r: int, numel: int) -> torch.Tensor:
    """What rank r must hold when rank i contributed i + 1 everywhere."""
    if variant == "all_reduce":
        return torch.full((numel,), n * (n + 1) / 2)
    if variant == "all_gather":
        return torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(numel // n)
    return torch.full((numel,), n * (n + 1) / 2)


def build(cfg: Config) -> Workload:
    n, r = world_size(), dist.get_rank()
    group = make_group(cfg)
    inp, out = buffers(cfg, n, 0.0)

    def check() -> dict:
        x, y = buffers(cfg, n, float(r + 1))
        call(cfg.variant, x, y, group)
        want = expected_result(cfg.variant, n, r, y.numel())
        return {"max_abs_error": (y.float().cpu() - want).abs().max().item()}

    big = out if cfg.variant == "all_gather" else inp  # S
    size = big.numel() * big.element_size()
    return Workload(step=lambda: call(cfg.variant, inp, out, group), check=check,
                    tensors={"message_bytes": lambda: [big]},
                    per_second={"algbw_gbps": size / 1e9,
                                "busbw_gbps": size * bus_factor(cfg.variant, n) / 1e9},
                    notes=notes(cfg), count_flops=False, compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    err = outputs["max_abs_error"]
    ok = err <= TOLERANCE
    return Comparison({"max_abs_error": err}, ok, "" if ok else f"result off by {err:g}")


def expected(cfg: Config) -> dict[str, float]:
    n = cfg.nproc or 2
    size = cfg.message_bytes
    moved = size * bus_factor(cfg.variant, n)  # bytes through each rank's busiest link
    out = {"message_bytes": float(size)}
    ceiling, _ = link_gbps(cfg)
    if ceiling and moved:  # one rank moves nothing over a link: no bandwidth to predict
        out.update(busbw_gbps=ceiling, algbw_gbps=ceiling / bus_factor(cfg.variant, n),
                   step_ms=moved / (ceiling * 1e9) * 1e3)
    return out


def notes(cfg: Config) -> dict[str, str]:
    _, source = link_gbps(cfg)
    env = {**_DEFAULT_NCCL, **nccl_env(cfg)} if cfg.device.startswith("cuda") else {}
    settings = ", ".join(f"{k}={v or 'default'}" for k, v in env.items())
    return {"busbw_gbps": f"predicted: the ceiling, {source}." + (f" {settings}." if settings else ""),
            "step_ms": f"predicted: the {bus_factor(cfg.variant, cfg.nproc or 2):.2f} x S bytes each rank "
                       "moves, at the ceiling (latency not modelled)."}
