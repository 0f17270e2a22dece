"""Attention kernels: the same causal self-attention written out, fused, and sparse.

Attention is softmax(q k^T / sqrt(d)) v over (batch, heads, seq_len, head_dim) tensors, with a
causal mask (and, with `window` > 0, a sliding window: each query sees its last `window` keys).
- `naive` (the reference): matmul, mask, softmax, matmul. It materializes the S x S scores and
  keeps the probabilities for backward: memory quadratic in seq_len, and several passes over them.
- `sdpa`: `F.scaled_dot_product_attention`, PyTorch choosing the backend for the device.
- `math`, `efficient`, `flash`, `cudnn`: SDPA with one backend forced by `sdpa_kernel`. `math` is
  PyTorch's own composite (the naive ops); the fused kernels work on blocks of q and k, keep a
  running max and sum (online softmax), never store the S x S matrix, and save only q, k, v, the
  output and one logsumexp per row for backward, which recomputes the scores: memory linear in
  seq_len, and a causal kernel skips the blocks above the diagonal.
- `flex_sliding`: `flex_attention` with a sliding-window `BlockMask`: blocks wholly outside the
  window are never computed (sparse attention). Needs `torch.compile` to be fast.
Grouped-query attention (num_kv_heads < num_heads) shares each k, v head among a group of q
heads: `naive` copies k and v out to every head; the fused kernels read them in place.
Every variant computes the same function: its output and q, k, v gradients must match `naive`'s.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from labkit import hardware
from labkit.config import DTYPE_BYTES, ConfigError, RunConfig, knob, torch_dtype
from labkit.workload import Comparison, Workload

VARIANTS = ("naive", "sdpa", "math", "efficient", "flash", "cudnn", "flex_sliding")
REFERENCE = "naive"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"seq_len": 256}, {"seq_len": 128, "batch_size": 2})

# seq_len is attention's own (no positions); on a GPU bf16: the fused kernels (flash, cuDNN) take
# no fp32
SIZES = {"tiny": {"seq_len": 512}, "small": {"dtype": "bfloat16"}, "medium": {"dtype": "bfloat16"}}
BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
CAN_USE = {"efficient": "can_use_efficient_attention", "flash": "can_use_flash_attention",
           "cudnn": "can_use_cudnn_attention"}
UNFUSED = ("naive", "math")  # these materialize the S x S matrices
# Largest difference against naive, relative to the largest reference value (output or gradient).
TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 5e-3}
LSE_BYTES = 4  # the fused kernels keep one fp32 logsumexp per query row


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="attention implementation")
    window: int = knob(0, min=0, help="sliding window in tokens, every variant (0: full causal)")
    # Random q, k, v have no positions: seq_len is not capped by the preset's context.
    uses_seq_len = False


def validate(cfg: Config) -> None:
    if cfg.window >= cfg.seq_len:
        raise ConfigError(f"window={cfg.window} must be shorter than seq_len={cfg.seq_len} "
                          "(0: full causal attention)")


# --- the implementations: (B, H, S, D) q and (B, KV, S, D) k, v -> (B, H, S, D) -------------------

def naive_attention(q, k, v, blocked: torch.Tensor) -> torch.Tensor:
    """`blocked` (S, S) bool: the keys each query may not see."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # GQA: a copy of each k, v head per q head
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, S, S)
    scores = scores.masked_fill(blocked, float("-inf"))  # keeps `blocked` (an input) for backward
    return torch.softmax(scores, dim=-1) @ v  # softmax keeps its (B, H, S, S) output for backward


def sdpa_attention(q, k, v, allowed: torch.Tensor | None) -> torch.Tensor:
    """Full causal takes `is_causal` (the kernels skip masked blocks); a window takes the mask."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None,
                                          enable_gqa=True)


def sliding_window(window: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return mask_mod


@functools.cache
def compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def allowed_keys(seq_len: int, window: int, device: str) -> torch.Tensor:
    """(S, S) bool: causal, and within `window` keys when window > 0."""
    i = torch.arange(seq_len, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & ((distance < window) if window else True)


def make_attention(cfg: Config):
    """attend(q, k, v) for the variant, with its mask built once (an input, not an activation)."""
    allowed = allowed_keys(cfg.seq_len, cfg.window, cfg.device)
    if cfg.variant == "naive":
        blocked = ~allowed
        return lambda q, k, v: naive_attention(q, k, v, blocked)
    if cfg.variant == "flex_sliding":
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(sliding_window(cfg.window), None, None, cfg.seq_len,
                                       cfg.seq_len, device=cfg.device)
        return lambda q, k, v: compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=True)
    mask = allowed if cfg.window else None
    if cfg.variant == "sdpa":
        return lambda q, k, v: sdpa_attention(q, k, v, mask)

    def forced(q, k, v):
        with sdpa_kernel(BACKENDS[cfg.variant]):
            return sdpa_attention(q, k, v, mask)
    return forced


# --- which variants run here ----------------------------------------------------------------------

def skip_reason(cfg: Config) -> str | None:
    if cfg.variant == "flex_sliding":
        if not cfg.window:
            return ("flex_sliding is sliding-window attention: set window > 0 (e.g. --set "
                    "window=256); every variant then applies the same window")
        return flex_refusal(cfg.device)
    if cfg.variant in CAN_USE:
        gqa = cfg.model.num_kv_heads != cfg.model.num_heads
        if cfg.device.startswith("cuda"):
            return cuda_refusal(cfg)
        return cpu_refusal(cfg.variant, cfg.dtype, gqa)
    return None


@functools.cache
def cpu_refusal(variant: str, dtype: str, gqa: bool) -> str | None:
    """Try the forced backend (forward and backward) on tiny tensors: which kernels this
    PyTorch build has for the CPU is checked, not assumed."""
    q = torch.randn(1, 2, 8, 16, dtype=torch_dtype(dtype), requires_grad=True)
    kv = q[:, :1] if gqa else q
    try:
        with sdpa_kernel(BACKENDS[variant]):
            sdpa_attention(q, kv, kv, None).sum().backward()
    except RuntimeError as e:
        return f"no {variant} SDPA kernel for the CPU in this PyTorch build: {str(e).splitlines()[0]}"
    return None


def cuda_refusal(cfg: Config) -> str | None:
    """PyTorch's own check for this backend at the run's shapes, dtype and mask; its reasons."""
    m, dtype = cfg.model, torch_dtype(cfg.dtype)
    q = torch.empty(cfg.batch_size, m.num_heads, cfg.seq_len, m.head_dim, device=cfg.device,
                    dtype=dtype, requires_grad=True)
    kv = torch.empty(cfg.batch_size, m.num_kv_heads, cfg.seq_len, m.head_dim, device=cfg.device,
                     dtype=dtype, requires_grad=True)
    mask = allowed_keys(cfg.seq_len, cfg.window, cfg.device) if cfg.window else None
    params = torch.backends.cuda.SDPAParams(q, kv, kv, mask, 0.0, mask is None, True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = getattr(torch.backends.cuda, CAN_USE[cfg.variant])(params, debug=True)
    if ok:
        return None
    why = "; ".join(str(w.message).splitlines()[0] for w in caught) or "no reason given"
    return f"PyTorch cannot use the {cfg.variant} kernel here: {why}"


@functools.cache
def flex_refusal(device: str) -> str | None:
    from torch.nn.attention.flex_attention import flex_attention

    if device.startswith("cuda"):
        missing = "flex_attention compiles to Triton kernels; Triton is missing"
        return None if hardware.has_triton() else missing
    q = torch.randn(1, 1, 16, 16, requires_grad=True)
    try:
        flex_attention(q, q, q)  # refused before computing anything when it cannot run
    except NotImplementedError as e:
        return f"flex_attention on the CPU: {str(e).splitlines()[0]}"
    return None


# --- the experiment -------------------------------------------------------------------------------

def make_inputs(cfg: Config) -> tuple[torch.Tensor, ...]:
    """Seeded q (B, H, S, D), k and v (B, KV, S, D) requiring grad, and the output's gradient."""
    m, gen = cfg.model, torch.Generator().manual_seed(cfg.seed)
    shapes = [(cfg.batch_size, h, cfg.seq_len, m.head_dim)
              for h in (m.num_heads, m.num_kv_heads, m.num_kv_heads, m.num_heads)]
    q, k, v, grad_out = (torch.randn(s, generator=gen).to(cfg.device, torch_dtype(cfg.dtype))
                         for s in shapes)
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), grad_out


def build(cfg: Config) -> Workload:
    attend = make_attention(cfg)
    q, k, v, grad_out = make_inputs(cfg)
    leaves = (q, k, v)

    def step() -> torch.Tensor:
        for t in leaves:
            t.grad = None
        out = attend(q, k, v)
        out.backward(grad_out)
        return out

    def check() -> dict:
        out = step()
        return {"out": out.detach(), "grads": [t.grad.detach().clone() for t in leaves]}

    def forward():
        # q, k, v as a projection would produce them (made in the pass, so counted if saved); the
        # graph is returned without the output, so the output counts only if the kernel saved it.
        return attend(q.clone(), k.clone(), v.clone()).grad_fn

    def forward_only():
        return attend(q, k, v)

    flex = cfg.variant == "flex_sliding"

    def report() -> dict[str, float]:
        return {"activation_bytes": saved_for_backward_bytes(forward)} if flex else {}

    # The harness's meters are dispatch modes, and flex_attention's higher-order op has no rule for
    # them (NotImplementedError): flex's saved bytes come from saved-tensor hooks, its FLOPs uncounted.
    return Workload(step=step, check=check, tokens_per_step=cfg.batch_size * cfg.seq_len,
                    forward=None if flex else forward, report=report, count_flops=not flex,
                    timed={"fwd_ms": forward_only},
                    notes=notes(cfg), compute_dtype=cfg.dtype)


def saved_for_backward_bytes(forward) -> int:
    """Bytes of the distinct storages autograd saves during `forward` (the graph is dropped after)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Output and q, k, v gradients against naive's: largest absolute difference, and that over
    the largest reference value (a relative figure that small entries cannot blow up)."""
    pairs = {"out": [(reference["out"], outputs["out"])],
             "grad": list(zip(reference["grads"], outputs["grads"]))}
    metrics = {}
    for name, tensors in pairs.items():
        diff = max((a.float() - b.float()).abs().max().item() for a, b in tensors)
        scale = max(a.float().abs().max().item() for a, _ in tensors)
        metrics.update({f"{name}_max_abs_diff": diff, f"{name}_max_rel_diff": diff / scale})
    tolerance = TOLERANCE[cfg.dtype]
    worst = max(metrics["out_max_rel_diff"], metrics["grad_max_rel_diff"])
    ok = worst <= tolerance
    return Comparison(metrics, ok, "" if ok else f"differs from naive by {worst:.2e} "
                                                 f"(relative; tolerance {tolerance:g} in {cfg.dtype})")


# --- napkin math ----------------------------------------------------------------------------------

def attention_flops(cfg: Config) -> dict[str, int]:
    """What the FLOP counter counts (multiply-add = 2): each of q k^T and p v is 2·B·H·S²·D, the
    causal half not subtracted. Backward: naive's two matmuls each need two (8·B·H·S²·D); a fused
    backward also recomputes q k^T (10·B·H·S²·D)."""
    m = cfg.model
    unit = cfg.batch_size * m.num_heads * cfg.seq_len ** 2 * m.head_dim
    backward = 8 if cfg.variant in UNFUSED else 10
    return {"forward": 4 * unit, "step": (4 + backward) * unit}


def saved_bytes(cfg: Config) -> int:
    """Bytes held for backward. naive: q, and k, v copied out to every q head (q k^T and p v keep
    their inputs) plus the (B, H, S, S) probabilities: quadratic. Fused: q, k, v as given, the
    output and one fp32 logsumexp per query row: linear."""
    m, size = cfg.model, DTYPE_BYTES[cfg.dtype]
    per_head = cfg.batch_size * cfg.seq_len * m.head_dim * size  # one (B, 1, S, D) slice
    if cfg.variant == "naive":
        return 3 * m.num_heads * per_head + cfg.batch_size * m.num_heads * cfg.seq_len ** 2 * size
    lse = cfg.batch_size * m.num_heads * cfg.seq_len * LSE_BYTES
    return (2 * m.num_heads + 2 * m.num_kv_heads) * per_head + lse


def forward_bytes(cfg: Config) -> int:
    """Bytes a forward must move at least: read q, k, v and write the output; naive also writes
    and reads its (B, H, S, S) matrices once per op (scores, scale, mask, softmax, p v: 8 passes)."""
    m, size = cfg.model, DTYPE_BYTES[cfg.dtype]
    qkvo = cfg.batch_size * cfg.seq_len * m.head_dim * size * (2 * m.num_heads + 2 * m.num_kv_heads)
    if cfg.variant in UNFUSED:
        return qkvo + 8 * cfg.batch_size * m.num_heads * cfg.seq_len ** 2 * size
    return qkvo


def expected(cfg: Config) -> dict[str, float]:
    flops = attention_flops(cfg)
    out: dict[str, float] = {"flops": flops["step"], "out_max_abs_diff": 0.0, "grad_max_abs_diff": 0.0}
    if cfg.variant != "math":  # PyTorch's composite: measured only
        out["activation_bytes"] = saved_bytes(cfg)
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    peak = ceil.peak_tflops.get(cfg.dtype)
    if peak:
        out.update(tflops=peak, step_ms=flops["step"] / (peak * 1e9))
        fwd_s = flops["forward"] / (peak * 1e12)
        if ceil.bandwidth_gbps:
            fwd_s = max(fwd_s, forward_bytes(cfg) / (ceil.bandwidth_gbps * 1e9))
        out["fwd_ms"] = fwd_s * 1e3
    return out


def notes(cfg: Config) -> dict[str, str]:
    out = {"flops": "counted as FlopCounterMode counts: the full S x S (the causal half is not "
                    "subtracted), backward 8·B·H·S²·D unfused, 10·B·H·S²·D fused (q k^T recomputed).",
           "fwd_ms": "a forward with grad (what training runs), timed after the step. Predicted: "
                     "the slower of its FLOPs at peak and its bytes at the device's bandwidth.",
           "step_ms": "predicted: the counted FLOPs at peak. A causal fused kernel skips the blocks "
                      "above the diagonal, so it can beat this bound and its tflops overstate.",
           "activation_bytes": "held for backward, q, k, v included (made in the pass as a "
                               "projection would). naive: q, k and v per q head, and the S x S "
                               "probabilities; fused: q, k, v, the output, a logsumexp per row."}
    if cfg.variant == "math":
        out["activation_bytes"] += (" math is PyTorch's composite: it scales q and k apart and "
                                    "keeps its own masks, so it differs a little from naive's.")
    if cfg.variant == "flex_sliding":
        out["step_ms"] = ("flex_attention compiled by torch.compile (the first call, in the check, "
                          "compiles); blocks wholly outside the window are skipped, so it does "
                          "less work than dense attention. Its FLOPs are not counted: "
                          "FlopCounterMode has no rule for the flex_attention higher-order op.")
        out["activation_bytes"] = ("what autograd saves (saved-tensor hooks): q, k, v, the output "
                                   "and the logsumexp; predicted as for the fused SDPA kernels.")
    if cfg.window and cfg.variant not in ("naive", "flex_sliding"):
        out["activation_bytes"] += (" With a window, SDPA takes an explicit (S, S) mask, which "
                                    "some backends cannot take: PyTorch may fall back to math.")
    return out
