"""Exercises on weight-only quantization: the bytes of an int4 linear with a shorter last group,
and the decode speed-up that the bytes ratio bounds. They name RUNS["quant"].

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit.blocks import quant
from labkit.study.exercises import h200
from labkit.study.exercises.core import TOPICS, Exercise, Rows, Setup, close, show

GROUP = 64  # the run's default int4 group size


def down_proj(s: Setup) -> tuple[int, int]:
    """(out, in) of the MLP's down projection w2: its input width is the ffn size."""
    m = s.cfg("int4").model
    return m.hidden_size, m.ffn_size


def down_proj_bytes(s: Setup) -> int:
    n, k = down_proj(s)
    return quant.weight_bytes(n, k, "int4", GROUP)


def floor_groups_bytes(s: Setup) -> int:
    """The common mistake: K // group_size groups (the shorter last group forgotten)."""
    n, k = down_proj(s)
    return n * k // 2 + 4 * n * (k // GROUP)


def bytes_words(s: Setup) -> str:
    n, k = down_proj(s)
    return (f"The MLP's down projection w2 of the run's model is a {n} x {k} weight ({n} output "
            f"channels, {k} inputs). int4 with group_size {GROUP}: two 4-bit values per byte, and per "
            f"group of up to {GROUP} inputs of a channel one 16-bit scale and one 16-bit zero point. "
            f"{k} is not a multiple of {GROUP}: the last group of each row is shorter and has its own "
            "scale and zero point.")


def speedup_bound(s: Setup) -> float:
    from labkit.techniques import weight_quant

    cfg = s.cfg("int4")
    return weight_quant.predicted_weight_bytes(cfg, "none") / weight_quant.predicted_weight_bytes(cfg)


def measured_bytes_ratio(r: Rows, s: Setup) -> str | None:
    """The bound is a bytes ratio: the run's stored fp32 and int4 linears give it."""
    none, int4 = r.get("none", "weight_bytes"), r.get("int4", "weight_bytes")
    ratio = none / int4 if none and int4 else None
    return None if close(ratio, speedup_bound(s), 1e-9) else \
        f"the run's stored bytes give {show(ratio, 'x')}, not the formula's {show(speedup_bound(s), 'x')}"


def weights_words(s: Setup) -> str:
    from labkit.techniques import weight_quant

    cfg = s.cfg("int4")
    shapes = ", ".join(f"{n} x {k}" for n, k in weight_quant.linear_shapes(cfg.model))
    k = cfg.model.ffn_size
    groups = quant.num_groups(k, GROUP)
    return (f"The run's model is fp32 (4 bytes per weight). Its quantized linears, (outputs x inputs): "
            f"{shapes}. int4 group_size {GROUP}: half a byte per weight, plus a 16-bit scale and a "
            f"16-bit zero point per group of up to {GROUP} inputs of each output channel (a row of {k} "
            f"inputs has {groups} groups, the last of {k - (groups - 1) * GROUP}).")


def measured_weight_bytes(r: Rows, s: Setup) -> str | None:
    """The run stores exactly the formula's bytes for the whole model."""
    from labkit.techniques import weight_quant

    want = weight_quant.predicted_weight_bytes(s.cfg("int4"))
    got = r.get("int4", "weight_bytes")
    return None if got == want else f"the run stored {show(got, 'bytes')}, not the formula's {want}"


def gptq_bytes(s: Setup) -> int:
    """GPTQ stores RTN's int4 format: the same bytes for the whole model's linears."""
    from labkit.techniques import weight_quant

    return weight_quant.predicted_weight_bytes(s.cfg("gptq_int4"))


def gptq_supports(r: Rows, s: Setup) -> str | None:
    got, rtn = r.get("gptq_int4", "weight_bytes"), r.get("int4", "weight_bytes")
    return None if got == rtn == gptq_bytes(s) else \
        f"GPTQ stored {show(got, 'bytes')} and RTN {show(rtn, 'bytes')}, the formula {gptq_bytes(s):,}"


def hessian_bytes(s: Setup) -> int:
    """The common mistake: GPTQ's K x K fp32 Hessian kept beside each linear."""
    from labkit.techniques import weight_quant

    return gptq_bytes(s) + sum(4 * k * k for _, k in weight_quant.linear_shapes(s.cfg("gptq_int4").model))


def build_exercises() -> list[Exercise]:
    topic = TOPICS[5]
    return [
        Exercise(
            "gptq_int4_bytes", topic, "quant", answer=gptq_bytes, details=weights_words,
            evidence=lambda r, s: {"gptq": show(r.get("gptq_int4", "weight_bytes"), "bytes"),
                                   "rtn": show(r.get("int4", "weight_bytes"), "bytes"),
                                   "agreement": show(r.get("gptq_int4", "next_token_agreement")),
                                   "rtn_agreement": show(r.get("int4", "next_token_agreement"))},
            level=1, mistake=hessian_bytes, supports=gptq_supports, unit="bytes"),
        Exercise(
            "int4_group_bytes", topic, "quant",
            answer=down_proj_bytes, details=bytes_words,
            evidence=lambda r, s: {"measured": show(r.get("int4", "weight_bytes"), "bytes"),
                                   "ratio": show(r.get("int4", "weight_bytes_ratio"))},
            level=1, mistake=floor_groups_bytes,
            supports=measured_weight_bytes, unit="bytes"),
        Exercise(
            "int4_speedup_bound", topic, "quant",
            answer=speedup_bound, details=weights_words,
            evidence=lambda r, s: {"none_tps": show(r.get("none", "tokens_per_s"), "tokens/s"),
                                   "int4_tps": show(r.get("int4", "tokens_per_s"), "tokens/s"),
                                   "paths": r.get("int4", "packed_layers")},
            level=2, mistake=lambda s: 8.0,
            supports=measured_bytes_ratio, unit="x", rel_tol=0.03,
            words={"h200_int4": h200.int4_words()}),
    ]
