"""Exercises on weight-only quantization: the bytes of an int4 linear with a shorter last group,
and the decode speed-up that the bytes ratio bounds. They name RUNS["quant"]."""
from __future__ import annotations

from labkit.blocks import quant
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


def build_exercises() -> list[Exercise]:
    topic = TOPICS[5]
    return [
        Exercise(
            "int4_group_bytes", topic, "The bytes of an int4 linear with a shorter last group",
            "Weight-only int4 stores each weight in 4 bits and, per group of inputs, a scale and a "
            "zero point to dequantize with: w = (q - 8) x scale + zero.",
            "How many bytes does the int4 w2 take (packed values, scales and zero points)?", "quant",
            answer=down_proj_bytes, details=bytes_words,
            evidence=lambda r, s: {"measured": show(r.get("int4", "weight_bytes"), "bytes"),
                                   "ratio": show(r.get("int4", "weight_bytes_ratio"))},
            why="out x ceil(in / 2) bytes of packed values plus 2 x 2 bytes x out x ceil(in / 64) "
                "groups = {answer} bytes. The whole model's int4 linears measured {measured} from "
                "storage, {ratio} of fp32: the same formula, layer by layer.",
            level=1, hint="Count the groups per row with a ceiling, not a floor; each group costs "
                          "two 16-bit numbers per output channel.",
            mistake=floor_groups_bytes,
            mistake_why="that counts in // 64 groups per row; the inputs past the last full group "
                        "form a shorter group that still needs its own scale and zero point.",
            supports=measured_weight_bytes, unit="bytes"),
        Exercise(
            "int4_speedup_bound", topic, "The decode speed-up that the bytes allow",
            "At batch 1 each decode step reads every weight once and does little arithmetic per "
            "byte, so the step time is bounded below by bytes / bandwidth. Assume a step reads only "
            "the quantized linears (the embedding rows, the norms and the short cache are "
            "negligible) and that the kernel reads the packed bytes themselves.",
            "By what factor at most can int4 (group_size 64) decode faster than fp32?", "quant",
            answer=speedup_bound, details=weights_words,
            evidence=lambda r, s: {"none_tps": show(r.get("none", "tokens_per_s"), "tokens/s"),
                                   "int4_tps": show(r.get("int4", "tokens_per_s"), "tokens/s"),
                                   "paths": r.get("int4", "packed_layers")},
            why="fp32 bytes / int4 bytes of the same linears = {answer}x: 32 bits against "
                "4 + 32/64 = 4.5 bits per weight, a little more where a row ends in a shorter "
                "group. It is a bound: here fp32 ran at {none_tps} and int4 at {int4_tps} ({paths} "
                "layers on the packed kernel); small matmuls on a CPU are bound by per-step "
                "overhead and by how fast the kernel unpacks, not by bytes.",
            level=2, hint="Write the bits per weight of each: data plus the scale and zero point "
                          "shared by a group of 64.",
            mistake=lambda s: 8.0,
            mistake_why="32 / 4 = 8 forgets the 16-bit scale and zero point of every group: int4 "
                        "with group 64 is 4.5 bits per weight, not 4.",
            supports=measured_bytes_ratio, unit="x", rel_tol=0.03),
    ]
