"""Exercises on profiling: the data wait, tensor-core shapes, arithmetic intensity, the roofline,
strided traffic.

Their words are in notebooks/exercises/text/KEY.md, one file per exercise (`text` reads them)."""
from __future__ import annotations

from labkit.study.exercises import h200
from labkit.study.exercises.core import TOPICS, Exercise, Rows, Setup, show
from labkit.study.exercises.formulas import tensor_core_friendly
from labkit.measure.profiler import SMALL_US

SCENARIO_SHAPE = 4095  # the tensor-core scenario's m = n = k (fp16)
# An op shorter than SMALL_US (10 µs) is launch/overhead-bound: a kernel launch alone costs
# ~4-6 µs, plus PyTorch's dispatch (the profiler's threshold, labkit.measure.profiler).
PAD, NOTHING = "pad each dimension to a multiple of 8", "nothing: since cuBLAS 11 any shape runs on tensor cores"
BOUNDS = ("compute-bound", "memory-bound", "launch/overhead-bound")


def _mm(s: Setup, variant: str = "fp32", alignment: str = "aligned"):
    return s.cfg(variant, alignment=alignment)


def _roof(s: Setup) -> dict[str, float]:
    """The 256^3 fp32 matmul against this device's ceilings: seconds at the peak FLOP/s, at the
    bandwidth, and the intensity and ridge point (FLOP/byte)."""
    from labkit import hardware
    from labkit.techniques import matmul

    cfg = _mm(s)
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    peak, bandwidth = ceil.peak_tflops["float32"] * 1e12, ceil.bandwidth_gbps * 1e9
    flops, nbytes = matmul.flops(cfg), matmul.min_bytes(cfg)
    return {"peak": peak, "bandwidth": bandwidth, "flops": flops, "bytes": nbytes,
            "compute_s": flops / peak, "memory_s": nbytes / bandwidth,
            "intensity": flops / nbytes, "ridge": peak / bandwidth, "name": ceil.name}


def _intensity(s: Setup) -> float:
    """2mnk FLOPs over the least bytes (A, B read once, C written once): needs no ceilings."""
    from labkit.techniques import matmul

    return matmul.flops(_mm(s)) / matmul.min_bytes(_mm(s))


def _roofline_bound(s: Setup) -> str:
    r = _roof(s)
    if max(r["compute_s"], r["memory_s"]) * 1e6 < SMALL_US:
        return "launch/overhead-bound"  # the roofline's time is below the fixed cost of one op
    return "compute-bound" if r["compute_s"] > r["memory_s"] else "memory-bound"


def _roof_details(s: Setup) -> str:
    r, (m, n, k) = _roof(s), _dims(_mm(s))
    return (f"Device: {s.device} ({r['name']}). Ceilings: fp32 peak {r['peak'] / 1e12:.4g} TFLOP/s, "
            f"memory bandwidth {r['bandwidth'] / 1e9:.4g} GB/s. The matmul: m = {m}, n = {n}, k = {k}, "
            f"fp32 (4 bytes); 2mnk FLOPs; least traffic A and B read once, C written once. An op whose "
            f"roofline time (the longer of FLOPs / peak and bytes / bandwidth) is under {SMALL_US:g} µs "
            "is launch/overhead-bound: a kernel launch alone costs a few µs, plus PyTorch's dispatch.")


def _dims(cfg) -> tuple[int, int, int]:
    from labkit.techniques import matmul

    return matmul.dims(cfg)


def _roof_supports(r: Rows, s: Setup) -> str | None:
    """What the answer rests on ran: 2mnk FLOPs counted and fp32 inputs of (mk + kn) x 4 bytes;
    and the measured rate stays under the roof (it cannot pass it unless the ceiling is wrong)."""
    m, n, k = _dims(_mm(s))
    at = {"alignment": "aligned"}
    if r.get("fp32", "flops", **at) != 2 * m * n * k or r.get("fp32", "input_bytes", **at) != (m * k + k * n) * 4:
        return "the measured FLOPs or input bytes are not those of the stated matmul"
    pct = r.get("fp32", "peak_flops_pct", **at)
    return None if pct is not None and pct <= 100 else f"the measured rate is {show(pct, '%')} of the roof"


def _intensity_supports(r: Rows, s: Setup) -> str | None:
    m, n, k = _dims(_mm(s))
    flops, inputs = r.get("fp32", "flops", alignment="aligned"), r.get("fp32", "input_bytes", alignment="aligned")
    if flops is None or inputs is None:
        return "the run has no FLOP or input-byte rows"
    measured = flops / (inputs + m * n * 4)
    want = 2 * m * n * k / ((m * k + k * n + m * n) * 4)
    return None if abs(measured - want) <= 1e-9 * want else (
        f"counted FLOPs / bytes give {show(measured)}, not {show(want)} FLOP/byte")


def _shape_supports(r: Rows, s: Setup) -> str | None:
    """The fp16 shapes ran as stated: 2-byte inputs, and the aligned and mult8 shapes are 16-byte
    aligned while off_by_one is not (checked from the counted FLOPs' dimensions)."""
    for alignment, friendly in (("aligned", True), ("mult8", True), ("off_by_one", False)):
        m, n, k = _dims(_mm(s, "fp16", alignment))
        if r.get("fp16", "input_bytes", alignment=alignment) != (m * k + k * n) * 2:
            return f"the fp16 {alignment} row's inputs are not 2 bytes per element"
        if r.get("fp16", "flops", alignment=alignment) != 2 * m * n * k:
            return f"the fp16 {alignment} row did not run m, n, k = {m}, {n}, {k}"
        if tensor_core_friendly(m, n, k) != friendly:
            return f"{alignment} ({m}) is not the alignment the explanation uses"
    return None


def _shape_evidence(r: Rows, s: Setup) -> dict[str, str]:
    rate = {a: show(r.get("fp16", "tflops", alignment=a), "TFLOP/s") for a in ("aligned", "mult8", "off_by_one")}
    dims = {a: _dims(_mm(s, "fp16", a))[0] for a in rate}
    gpu = s.device.startswith("cuda")
    where = ("on this GPU; at this size a launch's fixed cost can hide most of the difference, which "
             "shows at thousands (notebook 20_matmul)" if gpu else
             "on this CPU, which has no tensor cores: these rates show its vector units and fp16 "
             "conversion, not the rule; the rule can only be measured on a GPU (notebook 20_matmul)")
    return {"rates": ", ".join(f"{dims[a]}: {rate[a]}" for a in rate), "where": where}


def _reads_ratio(cfg) -> float:
    """The strided copy's read bytes over the contiguous one's: the ratio without the writes."""
    from labkit.techniques import memory_access as ma

    line = ma.LINE_BYTES[cfg.device.split(":")[0]]
    return min(cfg.stride * ma.ELEMENT_BYTES, line) / ma.ELEMENT_BYTES


def _strided_supports(r: Rows, s: Setup) -> str | None:
    """The strided view spans a buffer `stride` times the contiguous one (so each line fetched
    holds 1/stride of it in use) and writes the same contiguous output."""
    stride = s.cfg("strided").stride
    src = [r.get(v, "src_bytes") for v in ("contiguous", "strided")]
    dst = [r.get(v, "dst_bytes") for v in ("contiguous", "strided")]
    if None in src or src[1] != stride * src[0]:
        return f"the strided source does not span {stride} x the contiguous one"
    return None if dst[0] == dst[1] else "the two copies do not write the same bytes"


def _data_supports(r: Rows, s: Setup) -> str | None:
    """The loader did the stated work: the same batches as the reference, and a measured data time
    within a generous factor of batch x cost (a calibrated real workload, not a sleep)."""
    from labkit.techniques import dataloading

    want, got = dataloading.data_ms(s.cfg("baseline")), r.get("baseline", "data_ms")
    if r.get("baseline", "batches_match") != 1.0:
        return "the loader did not deliver the reference's batches"
    return None if got is not None and want / 2 <= got <= 3 * want else (
        f"the measured data time {show(got, 'ms')} is far from {show(want, 'ms')}")


def build_exercises() -> list[Exercise]:
    return [*_loading_and_shapes(), *_roofline()]


def _loading_and_shapes() -> list[Exercise]:
    topic = TOPICS[4]
    from labkit.techniques import dataloading

    return [
        Exercise(
            "data_wait", topic, "data",
            answer=lambda s: dataloading.data_ms(s.cfg("baseline")),
            evidence=lambda r, s: {"data": show(r.get("baseline", "data_ms"), "ms"),
                                   "compute": show(r.get("baseline", "compute_ms"), "ms"),
                                   "wait": show(r.get("baseline", "data_wait_pct"), "%")},
            level=1, unit="ms", rel_tol=0.15,
            mistake=lambda s: s.cfg("baseline").sample_cost_us / 1e3,
            supports=_data_supports),
        Exercise(
            "tensor_core_shape", topic, "matmul",
            choices=(PAD, NOTHING, "switch to fp32", "transpose B"), mistake=lambda s: NOTHING,
            answer=lambda s: NOTHING if tensor_core_friendly(*(SCENARIO_SHAPE,) * 3) else PAD,
            evidence=_shape_evidence,
            level=2,
            supports=_shape_supports, words={"shape": SCENARIO_SHAPE, "h200_matmul": h200.matmul_words()}),
    ]


def _roofline() -> list[Exercise]:
    topic = TOPICS[4]
    from labkit.techniques import memory_access as ma

    return [
        Exercise(
            "matmul_intensity", topic, "matmul",
            answer=_intensity,
            evidence=lambda r, s: {"flops": show(r.get("fp32", "flops", alignment="aligned"), "FLOP"),
                                   "inputs": show(r.get("fp32", "input_bytes", alignment="aligned"), "bytes")},
            level=1, unit="FLOP/byte", rel_tol=0.02,
            mistake=lambda s: _intensity(s) / 2,
            supports=_intensity_supports),
        Exercise(
            "roofline_bound", topic, "matmul",
            choices=BOUNDS, answer=_roofline_bound,
            mistake=lambda s: "compute-bound" if _roofline_bound(s) != "compute-bound" else "memory-bound",
            evidence=lambda r, s: {"tflops": show(r.get("fp32", "tflops", alignment="aligned"), "TFLOP/s"),
                                   "ms": show(r.get("fp32", "step_ms", alignment="aligned"), "ms"),
                                   "pct": show(r.get("fp32", "peak_flops_pct", alignment="aligned"), "%"),
                                   "compute_us": show(_roof(s)["compute_s"] * 1e6, "µs"),
                                   "memory_us": show(_roof(s)["memory_s"] * 1e6, "µs")},
            level=3,
            supports=_roof_supports, details=_roof_details, words={"small_us": SMALL_US}),
        Exercise(
            "strided_traffic", topic, "access",
            answer=lambda s: ma.traffic_bytes(s.cfg("strided")) / ma.traffic_bytes(s.cfg("contiguous")),
            evidence=lambda r, s: {"t_strided": show(r.get("strided", "step_ms"), "ms"),
                                   "t_contig": show(r.get("contiguous", "step_ms"), "ms"),
                                   "src": show(r.get("strided", "src_bytes") / r.get("contiguous", "src_bytes"))},
            level=2, rel_tol=0.05,
            mistake=lambda s: _reads_ratio(s.cfg("strided")),
            supports=_strided_supports),
    ]
