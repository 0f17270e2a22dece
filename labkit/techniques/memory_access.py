"""Memory access: the same values read in different orders, and what the order costs.

Memory moves in whole lines (64 bytes on a CPU, 32-byte sectors of 128-byte lines on a GPU),
so what a kernel pays for is the lines it touches, not the elements it uses. A GPU warp's 32
loads to neighbouring addresses merge into few transactions ("coalescing"); scattered ones each
fetch a sector of their own. Every variant reads the same N float32 values (laid out as an R x C
matrix) and either copies them into a contiguous (R, C) tensor (`op=copy`) or sums each row
(`op=sum`, one add per element: a point on the roofline's bandwidth slope):
- `contiguous` (the reference): the values in order; every byte of every line is used.
  At a size well past the caches its copy rate is the device's copy bandwidth, which the
  roofline uses as its ceiling.
- `strided`: every `stride`-th element of a buffer `stride` times larger: each line brings
  line/stride useful elements, so up to line/4 bytes are fetched per 4 used.
- `transposed`: a transposed view (column-major) read into row-major order: one of the two sides
  walks memory with a stride of a whole row; a tiled copy can keep the lines in cache.
- `gather`: the values at a random permutation of indices (`index_select`): each read is a line
  of its own, plus the 8-byte index.
`gbps` counts the bytes the program asks for (values and indices read, results written) over the
step time; the prediction divides the lines it must fetch by the device's copy bandwidth. All
variants give exactly the reference's result (the values are small integers, so sums are exact).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from labkit import hardware
from labkit.config import ConfigError, RunConfig, knob
from labkit.workload import Comparison, Workload

VARIANTS = ("contiguous", "strided", "transposed", "gather")
REFERENCE = "contiguous"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"size_mib": 16},)

OPS = ("copy", "sum")
LINE_BYTES = {"cpu": 64, "cuda": 32}  # the unit memory is fetched in: a cache line, a GPU sector
DEFAULT_MIB = {"cpu": 64, "cuda": 512}  # past the last-level cache (32 MiB here, 50 MiB on H100)
ELEMENT_BYTES = 4  # float32
INDEX_BYTES = 8  # int64 indices of `gather`
FILL = 2.0  # the strided buffer's other elements: never one of the values, so a wrong read shows


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="access pattern")
    size_mib: float = knob(0.0, min=0.0, help="MiB of values read (0: 64 on a CPU, 512 on a GPU)")
    stride: int = knob(4, min=2, help="strided: read every stride-th element")
    op: str = knob("copy", choices=OPS, help="copy into a contiguous tensor, or sum each row")
    uses_seq_len = False


def reference_ignores(cfg: Config) -> tuple[str, ...]:
    """`contiguous` reads its values in order: no stride."""
    return ("stride",)


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"memory_access moves float32 values; dtype must be float32 (got {cfg.dtype}); "
                          f"valid variants: {', '.join(VARIANTS)}")
    if num_elements(cfg) < 1024:
        raise ConfigError(f"size_mib={cfg.size_mib} is under 1024 float32 values; valid: >= 0.004")


def num_elements(cfg: Config) -> int:
    mib = cfg.size_mib or DEFAULT_MIB[torch.device(cfg.device).type]
    return int(mib * 2**20) // ELEMENT_BYTES // 1024 * 1024  # a whole number of 1024-wide rows


def matrix_shape(cfg: Config) -> tuple[int, int]:
    """(R, C): C the largest power of two with C <= sqrt(N) (N is a multiple of 1024)."""
    n = num_elements(cfg)
    cols = 2 ** int(math.log2(math.isqrt(n)))
    return n // cols, cols


def make_source(cfg: Config, values: torch.Tensor) -> dict[str, torch.Tensor]:
    """The variant's storage holding `values` (R, C), and the (R, C) view the step reads."""
    if cfg.variant == "contiguous":
        return {"src": values, "view": values}
    if cfg.variant == "strided":
        buffer = torch.full((values.numel() * cfg.stride,), FILL, device=cfg.device)
        buffer[::cfg.stride] = values.flatten()
        return {"src": buffer, "view": buffer[::cfg.stride].view(values.shape)}
    if cfg.variant == "transposed":
        stored = values.t().contiguous()  # (C, R) row-major = (R, C) column-major
        return {"src": stored, "view": stored.t()}
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed + 1)
    index = torch.randperm(values.numel(), generator=gen, device=cfg.device)
    scattered = torch.empty(values.numel(), device=cfg.device)
    scattered[index] = values.flatten()  # so that scattered[index] == values
    return {"src": scattered, "index": index}


def build(cfg: Config) -> Workload:
    rows, cols = matrix_shape(cfg)
    gen = torch.Generator(device=cfg.device).manual_seed(cfg.seed)
    values = torch.randint(-1, 2, (rows, cols), generator=gen, device=cfg.device,
                           dtype=torch.float32)
    source = make_source(cfg, values)
    del values
    out = torch.empty(rows, cols, device=cfg.device) if cfg.op == "copy" else None

    def read() -> torch.Tensor:
        if cfg.variant != "gather":
            return source["view"]
        if out is not None:  # gather straight into the output
            return torch.index_select(source["src"], 0, source["index"], out=out.view(-1)).view(rows, cols)
        return torch.index_select(source["src"], 0, source["index"]).view(rows, cols)

    def step() -> torch.Tensor:
        if out is None:
            return read().sum(dim=1)  # (R,)
        if cfg.variant == "gather":
            return read()  # index_select wrote into `out`
        return out.copy_(read())

    tensors = {"src_bytes": lambda: [source["src"]]}
    if out is not None:
        tensors["dst_bytes"] = lambda: [out]
    if "index" in source:
        tensors["index_bytes"] = lambda: [source["index"]]
    per_second = {"gbps": useful_bytes(cfg) / 1e9}
    if cfg.op == "sum":
        per_second["tflops"] = num_elements(cfg) / 1e12  # one add per element
    return Workload(step=step, check=lambda: {"out": step().clone()}, tensors=tensors,
                    per_second=per_second, notes=notes(cfg), count_flops=False)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Exactly the reference's values (copies) or row sums (sums of small integers are exact)."""
    diff = (outputs["out"] - reference["out"]).abs().max().item()
    ok = diff == 0.0
    return Comparison({"max_abs_diff": diff}, ok, "" if ok else f"values differ by up to {diff}")


def useful_bytes(cfg: Config) -> int:
    """What the program asks for: the values (and indices) read, the results written."""
    n, (rows, _) = num_elements(cfg), matrix_shape(cfg)
    written = n * ELEMENT_BYTES if cfg.op == "copy" else rows * ELEMENT_BYTES
    index = n * INDEX_BYTES if cfg.variant == "gather" else 0
    return n * ELEMENT_BYTES + index + written


def traffic_bytes(cfg: Config) -> int:
    """What memory must move, in whole lines: the napkin math behind the predictions."""
    n, line = num_elements(cfg), LINE_BYTES[torch.device(cfg.device).type]
    per_value = {"strided": min(cfg.stride * ELEMENT_BYTES, line), "gather": line}
    read = n * per_value.get(cfg.variant, ELEMENT_BYTES)  # transposed: tiled, ideally no waste
    return useful_bytes(cfg) - n * ELEMENT_BYTES + read


def storage(cfg: Config) -> dict[str, int]:
    n = num_elements(cfg)
    src = n * ELEMENT_BYTES * (cfg.stride if cfg.variant == "strided" else 1)
    out = {"src_bytes": src}
    if cfg.op == "copy":
        out["dst_bytes"] = n * ELEMENT_BYTES
    if cfg.variant == "gather":
        out["index_bytes"] = n * INDEX_BYTES
    return out


def expected(cfg: Config) -> dict[str, float]:
    """The bytes each tensor holds; the step at the copy bandwidth for the lines it touches."""
    out: dict[str, float] = {**storage(cfg), "max_abs_diff": 0.0}
    bandwidth = hardware.bandwidth_gbps(cfg.device, num_threads=cfg.num_threads)
    if bandwidth:
        seconds = traffic_bytes(cfg) / (bandwidth * 1e9)
        out.update(step_ms=seconds * 1e3, gbps=useful_bytes(cfg) / seconds / 1e9)
        if cfg.op == "sum":
            out["tflops"] = num_elements(cfg) / seconds / 1e12
    return out


def notes(cfg: Config) -> dict[str, str]:
    line = LINE_BYTES[torch.device(cfg.device).type]
    out = {"gbps": "bytes asked for (values and indices read, results written) / step time; "
                   f"predicted: the copy bandwidth x asked-for / fetched bytes ({line}-byte lines)."}
    if cfg.variant == "strided":
        out["src_bytes"] = (f"the whole buffer the view spans: stride x the values; each {line}-byte "
                            f"line fetched holds {max(1, line // (cfg.stride * ELEMENT_BYTES))} "
                            "value(s) used.")
    if cfg.variant == "transposed":
        out["gbps"] += (" Predicted as contiguous (a tiled copy wastes no line); the shortfall is "
                        "the cost of the order.")
    if cfg.variant == "gather":
        out["gbps"] += " Predicted with one line per value read: random order defeats every line."
    return out
