"""The CUDA caching allocator: reserved against allocated against NVML, and fragmentation.

What PyTorch holds from the driver (reserved) against what tensors use (allocated) against what
the driver reports (NVML), over decoding requests of varying lengths.

- `default` (the reference): the caching allocator with fixed-size segments. Prompts of varying
  length and a KV cache grown by concatenation (a new, larger tensor every token) free blocks the
  next, larger request cannot use, so the allocator reserves more: fragmentation.
- `expandable`: the same allocations with `expandable_segments:True`: a segment grows in place
  (more physical pages mapped behind the same virtual range), so freed space at its end is reused
  and reserved stays near the allocated peak.
- `buffer_pool`: the KV cache allocated once at the longest length and reused by every request,
  against fresh allocations per token: no cache memory is allocated while decoding.
The generated tokens are identical in every variant: where memory comes from changes no number.
GPU only: the CPU has no caching allocator (tensors come straight from malloc), so the variants are
skipped there; the reference runs.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from labkit import planner
from labkit.hardware import set_allocator_settings
from labkit.config import RunConfig, knob, torch_dtype
from labkit.blocks.decoding import compare_tokens, generate_cached
from labkit.blocks.kv_caches import DynamicCache
from labkit.blocks.model import build_model
from labkit.workload import Comparison, Workload

VARIANTS = ("default", "expandable", "buffer_pool")
REFERENCE = "default"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"new_tokens": 16}, {"num_requests": 2, "new_tokens": 8, "num_layers": 2})



@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="where the memory comes from")
    prompt_len: int = knob(64, min=4, help="longest prompt (each request draws one from a "
                                           "quarter of it up to it)")
    new_tokens: int = knob(32, min=4, help="most tokens generated per request (drawn likewise)")
    num_requests: int = knob(4, min=1, help="requests decoded one after another per step")
    uses_seq_len = False  # lengths come from prompt_len and new_tokens


def schedule(cfg: Config) -> list[tuple[int, int]]:
    """Seeded (prompt length, new tokens) per request, each in [max / 4, max]."""
    gen = torch.Generator().manual_seed(cfg.seed + 2)

    def draw(most: int) -> int:
        return int(torch.randint(max(1, most // 4), most + 1, (1,), generator=gen))

    return [(draw(cfg.prompt_len), draw(cfg.new_tokens)) for _ in range(cfg.num_requests)]


class KVPool:
    """Every layer's keys and values in buffers allocated once, (B, kv_heads, max_len, hd); each
    request writes from position 0 and attends over views of the filled part."""

    def __init__(self, cfg: Config):
        m = cfg.model
        shape = (cfg.batch_size, m.num_kv_heads, cfg.prompt_len + cfg.new_tokens, m.head_dim)
        make = lambda: torch.zeros(shape, dtype=torch_dtype(cfg.dtype), device=cfg.device)  # noqa: E731
        self.keys = [make() for _ in range(m.num_layers)]
        self.values = [make() for _ in range(m.num_layers)]
        self.lengths = [0] * m.num_layers

    def reset(self) -> "KVPool":
        self.lengths = [0] * len(self.keys)  # reuse: nothing freed, nothing allocated
        return self

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        self.keys[layer][:, :, start:end] = k
        self.values[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]  # views, no copies

    def tensors(self) -> list[torch.Tensor]:
        return self.keys + self.values


def decode_requests(model, prompts: torch.Tensor, requests: list[tuple[int, int]],
                    pool: KVPool | None, last: dict) -> list[torch.Tensor]:
    """Greedy decoding of each request in turn, (B, new_tokens) each, with the pool reused or a
    fresh cache per request; `last["cache"]` keeps the latest cache (for `kv_bytes`)."""
    out = []
    for prompt_len, new_tokens in requests:
        last["cache"] = pool.reset() if pool is not None else DynamicCache(len(model.layers))
        out.append(generate_cached(model, prompts[:, :prompt_len], new_tokens, last["cache"]))
    return out


# ---------------------------------------------------------------- the allocator's settings


def env_expandable() -> bool:
    """Whether the environment asked for expandable segments (what to restore afterwards)."""
    conf = os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""
    return "expandable_segments:true" in conf.replace(" ", "").lower()


@contextlib.contextmanager
def expandable_segments(enabled: bool):
    """The allocator's `expandable_segments` set to `enabled` inside; the environment's after."""
    set_allocator_settings(f"expandable_segments:{enabled}")
    try:
        yield
    finally:
        set_allocator_settings(f"expandable_segments:{env_expandable()}")


def allocator_peaks(device: str) -> dict[str, float]:
    """Peaks since the last reset, from the caching allocator's counters (bytes)."""
    s = torch.cuda.memory_stats(device)
    allocated, reserved = s["allocated_bytes.all.peak"], s["reserved_bytes.all.peak"]
    return {"allocated_bytes": allocated, "reserved_bytes": reserved,
            "fragmentation_bytes": reserved - allocated,
            "inactive_split_bytes": s["inactive_split_bytes.all.peak"],
            "alloc_retries": s.get("num_alloc_retries", 0)}


def expandable_bytes(device: str) -> int:
    """Bytes reserved in expandable segments now: proof that the setting took (0 without it)."""
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
               if seg["device"] == index and seg.get("is_expandable"))


# ---------------------------------------------------------------- the experiment


def skip_reason(cfg: Config) -> str | None:
    if cfg.variant == REFERENCE:
        return None
    if not cfg.device.startswith("cuda"):
        return ("no caching allocator on the CPU: tensors come straight from the system allocator, "
                "so there is no reserved memory to fragment or pool (runs on a GPU)")
    if cfg.variant == "expandable" and torch.cuda.get_allocator_backend() != "native":
        return ("expandable segments are a setting of PyTorch's native caching allocator; this "
                f"process uses {torch.cuda.get_allocator_backend()}")
    return None


def build(cfg: Config) -> Workload:
    cuda = cfg.device.startswith("cuda")

    def settings():  # the reference and the pool run with fixed-size segments, whatever the env
        return expandable_segments(cfg.variant == "expandable") if cuda else contextlib.nullcontext()

    with settings():
        model = build_model(cfg.model, device=cfg.device, dtype=torch_dtype(cfg.dtype),
                            seed=cfg.seed, attention=cfg.attention).eval()
        pool = KVPool(cfg) if cfg.variant == "buffer_pool" else None
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompts = torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, cfg.prompt_len),
                            generator=gen).to(cfg.device)
    requests, last = schedule(cfg), {}

    def step() -> list[torch.Tensor]:
        with settings():
            if cuda:
                torch.cuda.reset_peak_memory_stats(cfg.device)
            out = decode_requests(model, prompts, requests, pool, last)
            if cuda:
                last.update(allocator_peaks(cfg.device))
        return out

    def report() -> dict[str, float]:
        out = {k: v for k, v in last.items() if k != "cache"}  # the allocator's peaks (CUDA)
        return {**out, "expandable_bytes": expandable_bytes(cfg.device)} if cuda else out

    return Workload(
        step=step, check=lambda: {"tokens": torch.cat([t.flatten() for t in step()])},
        tokens_per_step=cfg.batch_size * sum(n for _, n in requests),
        tensors={"param_bytes": model.parameters, "kv_bytes": lambda: last["cache"].tensors()},
        report=report,
        notes=notes(cfg), compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Every generated token identical to the reference's (`compare_tokens`; no variant is
    lossy, so no attention output is judged)."""
    return compare_tokens(reference, outputs, attn_tolerance=0.0)


def expected(cfg: Config) -> dict[str, float]:
    """Weights plus the longest request's cache (the pool: the cache at full length, always);
    activations of one decoding step are left out."""
    per_token = planner.kv_bytes_per_token(cfg.model, cfg.dtype) * cfg.batch_size
    if cfg.variant == "buffer_pool":
        kv = longest = per_token * (cfg.prompt_len + cfg.new_tokens)
    else:
        held = [p + n - 1 for p, n in schedule(cfg)]  # the last token is never fed back
        kv, longest = per_token * held[-1], per_token * max(held)
    peak = planner.param_bytes(cfg.model, cfg.dtype) + longest
    out = {"kv_bytes": kv, "token_agreement": 1.0, "peak_mem_bytes": peak}
    if cfg.device.startswith("cuda"):
        out["allocated_bytes"] = peak
    return out


def notes(cfg: Config) -> dict[str, str]:
    out = {"kv_bytes": "the cache of the step's last request; the pool's is its full buffer.",
           "peak_mem_bytes": "predicted: the weights and the longest request's cache (the pool: "
                             "its full buffer). Measured above it by the prefill's transient "
                             "activations, which the prediction leaves out: at the peak, the "
                             "longest prompt's feed-forward intermediates (three of batch x "
                             "prompt x ffn_size x 4 bytes) and the hidden states beside them."}
    if cfg.device.startswith("cuda"):
        out.update(
            allocated_bytes="peak bytes in live tensors during the step (the allocator's counters).",
            reserved_bytes="peak bytes the caching allocator held from the driver (cudaMalloc'd "
                           "segments, or mapped pages with expandable segments).",
            fragmentation_bytes="reserved peak less allocated peak: memory held but never needed "
                                "at once. Expandable segments are set at run time here "
                                "(torch._C._accelerator_setAllocatorSettings in newer torch, "
                                "torch.cuda.memory._set_allocator_settings in 2.6) and only affect "
                                "segments made afterwards; PYTORCH_CUDA_ALLOC_CONF="
                                "expandable_segments:True does the same for a whole process if "
                                "set before CUDA initialises.",
            inactive_split_bytes="peak bytes in free pieces of split blocks: the fragments.",
            expandable_bytes="reserved in expandable segments after the run (memory_snapshot): "
                             "non-zero only where the setting took.")
    return out
