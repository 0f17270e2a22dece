"""Context parallelism: one attention layer's sequence split over the ranks, S/n tokens each.

Attention alone, no projections: seeded q (B, H, S, D), k, v (B, KV, S, D) and the output's
gradient, the same on every rank; a rank takes its tokens of each.
- `single` (the reference): SDPA over the whole sequence in one process (every rank runs it).
- `ring`: contiguous blocks; k, v blocks passed round the ring, partial softmaxes merged by their
  log-sum-exp, the backward likewise (`labkit.blocks.ring`). Causal: the last rank does most.
- `ring_zigzag`: the same ring on the zig-zag split (pieces r and 2n-1-r of 2n): balanced work.
- `ulysses`: all-to-all to head shards, SDPA on H/n heads, all-to-all back (`blocks.ulysses`).
- `torch_cp`: PyTorch's `context_parallel` (ring attention over DTensor); NCCL ranks only.
Checked on every rank: its tokens of the output and of dq, dk, dv against `single`'s;
`ring_bug` puts a mistake in the ring on purpose, which that check must catch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from labkit import planner
from labkit.blocks import ring as ring_blocks
from labkit.blocks.distributed import DistConfig, default_nproc, rank, world_size
from labkit.blocks.ulysses import heads_refusal, ulysses_attention
from labkit.config import ConfigError, knob, torch_dtype
from labkit.measure.comm import CommCounter
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("single", "ring", "ring_zigzag", "ulysses", "torch_cp")
REFERENCE = "single"
RINGS = {"ring": "contiguous", "ring_zigzag": "zigzag"}  # variant -> how the sequence is split
# 4 heads of 64 and 4 kv heads (Ulysses on 4 ranks splits both four ways); 512 tokens
SIZES = {"tiny": {"num_kv_heads": 4, "batch_size": 1, "seq_len": 512}}
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"seq_len": 256, "timed_steps": 3}, {"seq_len": 128, "timed_steps": 2})
# Largest difference over the largest reference value (output; dq, dk, dv), fp32: the ring sums
# its blocks' softmaxes in another order than SDPA's kernel, a few ulps (1.2e-7 each).
TOLERANCE = 1e-5


@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="one process, ring (contiguous or zig-zag "
                                                          "split), Ulysses, or PyTorch's context_parallel")
    causal: bool = knob(True, help="causal attention (False: every token sees every token)")
    ring_bug: str = knob("none", choices=ring_blocks.BUGS,
                         help="a ring bug put in on purpose: no_rescale (partial softmaxes summed "
                              "without their log-sum-exp weights) or no_block_mask (later key "
                              "blocks attended); the check must fail")


def num_ranks(cfg: Config) -> int:
    return cfg.nproc or default_nproc(cfg.device)


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"context_parallel checks gradients in float32 (got {cfg.dtype}); valid: float32")
    planner.check_split(cfg.seq_len, num_ranks(cfg), "contiguous")


def skip_reason(cfg: Config) -> str | None:
    n, m = num_ranks(cfg), cfg.model
    if cfg.variant == "ulysses":
        return heads_refusal(m.num_heads, m.num_kv_heads, n)
    if cfg.variant == "ring_zigzag" and cfg.seq_len % (2 * n):
        return f"zig-zag splits seq_len={cfg.seq_len} into 2 x {n} blocks: use a multiple of {2 * n}"
    if cfg.variant == "torch_cp" and not cfg.device.startswith("cuda"):
        return ("needs NCCL ranks on GPUs: torch's context_parallel swaps in ring kernels only for "
                "the CUDA flash, efficient and cuDNN SDPA backends")
    return None


# --- the workload ---------------------------------------------------------------------------------

def make_inputs(cfg: Config) -> tuple[torch.Tensor, ...]:
    """Seeded whole-sequence q (B, H, S, D), k, v (B, KV, S, D) and the output's gradient."""
    m, gen = cfg.model, torch.Generator().manual_seed(cfg.seed)
    heads = (m.num_heads, m.num_kv_heads, m.num_kv_heads, m.num_heads)
    return tuple(torch.randn(cfg.batch_size, h, cfg.seq_len, m.head_dim, generator=gen)
                 .to(cfg.device, torch_dtype(cfg.dtype)) for h in heads)


def reference_ignores(cfg: Config) -> tuple[str, ...]:
    """`single` is one process's attention: no ring, so no ring_bug."""
    return ("ring_bug",)


def attention_for(cfg: Config):
    """(attend(q, k, v), this rank's (start, length) runs of the sequence, the Ring or None)."""
    if cfg.variant == REFERENCE:
        sdpa = functools.partial(F.scaled_dot_product_attention, is_causal=cfg.causal, enable_gqa=True)
        return sdpa, [(0, cfg.seq_len)], None
    if cfg.variant == "ulysses":
        runs = ring_blocks.pieces(cfg.seq_len, world_size(), rank(), "contiguous")
        return functools.partial(ulysses_attention, causal=cfg.causal), runs, None
    ring = ring_blocks.Ring(seq_len=cfg.seq_len, split=RINGS[cfg.variant], causal=cfg.causal,
                            bug=cfg.ring_bug)
    return functools.partial(ring_blocks.ring_attention, ring=ring), ring.runs(rank()), ring


def build(cfg: Config) -> Workload:
    if cfg.variant == "torch_cp":
        return build_torch_cp(cfg)
    attend, runs, ring = attention_for(cfg)
    q, k, v, grad_out = (ring_blocks.shard(t, runs) for t in make_inputs(cfg))
    leaves = tuple(t.requires_grad_() for t in (q, k, v))
    measured: dict[str, float] = {}

    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        out = attend(*leaves)
        out.backward(grad_out)
        return out

    def check() -> dict:
        if ring is not None:
            ring.attended_pairs, ring.compute_s = 0, 0.0
        with CommCounter() as counter:
            out = step()
        measured.update(counter.metrics())
        if ring is not None:
            measured["attended_pairs"] = ring.attended_pairs  # one forward's
        return {"out": out.detach().cpu(), "grads": [t.grad.detach().cpu() for t in leaves],
                "positions": ring_blocks.positions(runs)}

    def forward():
        # q, k, v made in the pass, as a projection would make them; the graph returned without
        # the output, so the output counts only where the attention saved it
        return attend(*(t.clone() for t in leaves)).grad_fn

    return Workload(step=step, check=check, tokens_per_step=cfg.batch_size * q.shape[2],
                    forward=forward, report=lambda: {**measured, **idle(ring)},
                    notes=notes(cfg), count_flops=False, compute_dtype=cfg.dtype)


def idle(ring) -> dict[str, float]:
    """This rank's share of the busiest rank's block-compute time spent waiting (every forward
    since the check, the same calls on every rank)."""
    if ring is None or not ring.compute_s:  # not timed on GPUs (labkit.blocks.ring)
        return {}
    times = [None] * world_size()
    torch.distributed.all_gather_object(times, ring.compute_s)
    return {"idle_fraction": 1 - ring.compute_s / max(times)}


def build_torch_cp(cfg: Config) -> Workload:
    """torch's context_parallel (GPUs): the buffers sharded in place (its head-tail load balance),
    its ring SDPA patched in for the forward and backward, the results unsharded whole. Its SDPA
    takes no grouped kv heads: k, v are repeated to every q head and their gradients summed back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    mesh = init_device_mesh("cuda", (world_size(),))
    q, k, v, grad_out = make_inputs(cfg)
    groups = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]

    def step():
        bufs = [t.clone() for t in (q, k, v, grad_out)]
        with context_parallel(mesh, buffers=bufs, buffer_seq_dims=[2] * 4, no_restore_buffers=set(bufs)), \
                sdpa_kernel(fused):
            leaves = [b.requires_grad_() for b in bufs[:3]]
            out = F.scaled_dot_product_attention(*leaves, is_causal=cfg.causal)
            out.backward(bufs[3])
        return out, leaves

    def check() -> dict:
        out, leaves = step()
        whole = context_parallel_unshard(mesh, [out.detach(), *(t.grad for t in leaves)], [2] * 4)
        b, h, s, d = whole[2].shape
        dk, dv = (g.view(b, h // groups, groups, s, d).sum(2) for g in whole[2:])
        return {"out": whole[0].cpu(), "grads": [whole[1].cpu(), dk.cpu(), dv.cpu()],
                "positions": torch.arange(cfg.seq_len)}

    return Workload(step=step, check=check, tokens_per_step=cfg.batch_size * cfg.seq_len // world_size(),
                    notes=notes(cfg), count_flops=False, compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """This rank's tokens of the output and of dq, dk, dv against the reference's same tokens:
    largest absolute difference over the largest reference value."""
    pos = outputs["positions"]
    pairs = {"out": [(reference["out"][:, :, pos], outputs["out"])],
             "grad": [(a[:, :, pos], b) for a, b in zip(reference["grads"], outputs["grads"])]}
    metrics = {}
    for name, tensors in pairs.items():
        diff = max((a.double() - b.double()).abs().max().item() for a, b in tensors)
        scale = max(a.abs().max().item() for a, _ in tensors)
        metrics[f"{name}_max_rel_diff"] = diff / scale
    worst = max(metrics.values())
    ok = bool(np.isfinite(worst)) and worst <= TOLERANCE
    return Comparison(metrics, ok, "" if ok else f"output or gradients differ from single by "
                                                 f"{worst:.2e} (relative; tolerance {TOLERANCE:g})")


# --- napkin math ----------------------------------------------------------------------------------

def shape(cfg: Config) -> dict[str, int]:
    m = cfg.model
    return {"batch": cfg.batch_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
            "seq_len": cfg.seq_len, "head_dim": m.head_dim}


def comm_formula(cfg: Config, n: int) -> dict[str, float]:
    """One step's point-to-point calls or all-to-alls, their bytes (`planner.context`)."""
    s = shape(cfg)
    kv = {k: s[k] for k in ("batch", "kv_heads", "seq_len", "head_dim")}
    if cfg.variant in RINGS:
        sent = planner.ring_sent_bytes(**kv, n=n)
        sends = planner.ring_sends(n)
        return {"comm_bytes": sent, "comm_bus_bytes": sent, "send_count": sends, "recv_count": sends}
    if cfg.variant == "ulysses":
        total = planner.ulysses_all_to_all_bytes(**s, n=n)
        return {"comm_bytes": total, "comm_bus_bytes": planner.ulysses_sent_bytes(**s, n=n),
                "all_to_all_count": 8.0 if n > 1 else 0.0}
    return {"comm_bytes": 0.0, "comm_bus_bytes": 0.0} if cfg.variant == REFERENCE else {}


def expected(cfg: Config) -> dict[str, float]:
    n = 1 if cfg.variant == REFERENCE else num_ranks(cfg)
    out = {"out_max_rel_diff": 0.0, "grad_max_rel_diff": 0.0,
           "activation_bytes": planner.cp_activation_bytes(**shape(cfg), n=n), **comm_formula(cfg, n)}
    if cfg.variant in RINGS:
        split, r = RINGS[cfg.variant], rank()
        out["attended_pairs"] = planner.causal_pairs(cfg.seq_len, n, split, causal=cfg.causal)[r]
        out["idle_fraction"] = planner.causal_idle_fraction(cfg.seq_len, n, split, causal=cfg.causal)[r]
    return {k: float(v) for k, v in out.items()}


def scaling_table(cfg: Config, max_ranks: int = 16):
    """Bytes each rank sends in one step (forward + backward) as the sequence grows with the
    ranks, 1, 2, 4, .. max_ranks, this run's S/n tokens on each: ring, Ulysses, and the bytes
    saved for backward per rank (the same for both). A DataFrame (pandas imported here, not
    by every rank)."""
    import pandas as pd

    per_rank, s, rows = cfg.seq_len // num_ranks(cfg), shape(cfg), []
    kv = {k: s[k] for k in ("batch", "kv_heads", "head_dim")}
    for n in (2**i for i in range(max_ranks.bit_length()) if 2**i <= max_ranks):
        seq = per_rank * n
        rows.append({"ranks": n, "seq_len": seq,
                     "ring": planner.ring_sent_bytes(**kv, seq_len=seq, n=n),
                     "ulysses": planner.ulysses_sent_bytes(**{**s, "seq_len": seq}, n=n),
                     "activation_bytes": planner.cp_activation_bytes(**{**s, "seq_len": seq}, n=n)})
    return pd.DataFrame(rows)


def notes(cfg: Config) -> dict[str, str]:
    return {"comm_bytes": "one step (forward + backward); S per call as nccl-tests counts it: a "
                          "send's tensor, an all-to-all's whole input. Predicted: planner.context.",
            "comm_bus_bytes": "bytes that leave this rank: every send's, (n-1)/n of an all-to-all's.",
            "activation_bytes": "saved for backward: q, k, v, the output and a log-sum-exp per "
                                "query row, of this rank's tokens (single: all S).",
            "attended_pairs": "allowed (query, key) pairs this rank's forward computed, per "
                              "sequence and head (counted by the ring's blocks).",
            "idle_fraction": "1 - this rank's block-compute time / the busiest rank's (timed, every "
                             "forward since the check). Predicted from the pairs scored, each "
                             "causal triangle computed as a whole block (planner.causal_block_work); "
                             "what every rank pays alike (merging, the hops, masking the diagonal "
                             "block that each computes) pulls it lower.",
            "step_ms": "forward + backward of one attention layer, no prediction: on CPU ranks "
                       "gloo over loopback sets much of it."}
