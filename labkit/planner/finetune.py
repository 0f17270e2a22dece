"""Fine-tuning: full, LoRA, QLoRA and LoRA on int8/int4 bases (`finetune_memory`,
`finetune_frontier`).

- LoRA (Hu et al. 2021) as PEFT builds it: each targeted nn.Linear W (out x in) gets A (r x in)
  and B (out x r), output W x + (alpha / r) B A x; the base is frozen (no gradients, no optimizer
  state). The adapters are in the compute dtype, as the base (labkit.blocks.lora passes
  autocast_adapter_dtype=False: PEFT's default would upcast 16-bit adapters to fp32), so are
  their gradients and AdamW's two moments (torch keeps them in the parameter's dtype), beside
  one fp32 step counter per adapter tensor.
- QLoRA (Dettmers et al. 2023) as torchao's NF4Tensor stores it: the block linears' weights in
  4 bits with int8 absmax scalers per `block_size` values, double-quantized (one factor per
  scaler block); the embedding, the norms and the head stay in the compute dtype. The paper's
  arithmetic: fp32 scales per 64 weights cost 32/64 = 0.5 bits per weight, 8-bit scales with
  fp32 second-level scales per 256 cost 8/64 + 32/(64·256) = 0.127.
- LoRA on a weight-only int8 or int4 base (`lora_int8`, `lora_int4`): the block linears in
  labkit.blocks.quant's round-to-nearest formats (`weight_only_bytes`: a byte a weight and a
  16-bit scale per row; 4-bit codes and a 16-bit scale and zero point per 64 inputs), each
  matmul dequantizing its weight (`weight_only_dequant_bytes`), as QLoRA does its NF4.
- A frozen linear saves nothing for backward (the input's gradient needs only the weight), so
  what LoRA keeps is what the adapters and the non-linear ops need: the norms, attention's
  inputs and output, the MLP's activation inputs; `_lora_layer_bytes` walks a block in order
  (checked exactly against saved-tensor hooks on PEFT's model in the tests).
"""
from __future__ import annotations

import dataclasses

from labkit import hardware
from labkit.config import DTYPE_BYTES, ConfigError, ModelConfig, check_choice
from labkit.planner.activations import (_attention_bytes, _document_mask_bytes, _embedding_side_bytes,
                                        _target_copy_bytes)
from labkit.planner.model import block_linear_params, local_shape
from labkit.planner.model import num_params as _count_params
from labkit.planner.plan import MemoryPlan, _positive, _resolve, _Run
from labkit.planner.precision import DTYPE_OF, LOW_BIT, low_bit_state_bytes, low_bit_update_bytes
from labkit.planner.quantized import (_dtype_name, nf4_bytes, nf4_dequant_bytes,
                                      weight_only_bytes, weight_only_dequant_bytes)
from labkit.planner.sharding import _fsdp2_units
from labkit.planner.training import training_memory


FINETUNE_METHODS = ("full", "lora", "qlora", "lora_int8", "lora_int4")
# the methods whose frozen base's block linears are stored quantized, and in what
BASE_FORMAT = {"qlora": "nf4", "lora_int8": "int8", "lora_int4": "int4"}
LORA_TARGET_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
LORA_TARGET_ALIASES = {"attn": ("q", "k", "v", "o"), "all": LORA_TARGET_NAMES}
# labkit's module names (labkit.blocks.model): SwiGLU is w2(silu(w1 x) * w3 x); GPT-2's MLP is
# w2(gelu(w1 x)), so its first linear is "up" and it has no gate.
LORA_MODULES = {"llama": {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w1", "up": "w3", "down": "w2"},
                "gpt2": {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2"}}
FINETUNE_CHECKPOINTING = ("none", "full")


def parse_lora_targets(spec: str | tuple | list) -> tuple[str, ...]:
    """"q,v" or ("q", "v"), with "attn" = q,k,v,o and "all" = all seven, as a tuple in
    LORA_TARGET_NAMES order without repeats; ConfigError naming the valid ones otherwise."""
    names = [n.strip() for n in spec.split(",")] if isinstance(spec, str) else list(spec)
    chosen: set[str] = set()
    for name in names:
        if name not in LORA_TARGET_NAMES and name not in LORA_TARGET_ALIASES:
            raise ConfigError(f"unknown LoRA target {name!r}; valid: "
                              f"{', '.join(LORA_TARGET_NAMES + tuple(LORA_TARGET_ALIASES))}")
        chosen.update(LORA_TARGET_ALIASES.get(name, (name,)))
    if not chosen:
        raise ConfigError(f"no LoRA targets given; valid: {', '.join(LORA_TARGET_NAMES)}, attn, all")
    return tuple(n for n in LORA_TARGET_NAMES if n in chosen)


def lora_module_names(m: ModelConfig, lora_targets=("q", "v")) -> list[str]:
    """labkit's attribute names of the targeted linears (PEFT's `target_modules`)."""
    modules = LORA_MODULES[m.arch]
    targets = parse_lora_targets(lora_targets)
    missing = [t for t in targets if t not in modules]
    if missing:
        raise ConfigError(f"LoRA target {missing[0]!r} does not exist in a {m.arch} block; "
                          f"valid: {', '.join(modules)}")
    return [modules[t] for t in targets]


def linear_shapes(m: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each block linear, by target name."""
    s = local_shape(m, 1)
    shapes = {"q": (s.q, s.d), "k": (s.kv, s.d), "v": (s.kv, s.d), "o": (s.d, s.q),
              "gate": (s.f, s.d), "up": (s.f, s.d), "down": (s.d, s.f)}
    return {t: shapes[t] for t in LORA_MODULES[m.arch]}


def trainable_params(m: ModelConfig, method: str, *, lora_rank: int = 8,
                     lora_targets=("q", "v")) -> int:
    """Parameters the optimizer updates: all of them for full fine-tuning; for (Q)LoRA
    layers x sum over targets of r·(in + out) (A is r x in, B is out x r)."""
    check_choice("finetune method", method, FINETUNE_METHODS)
    if method == "full":
        return _count_params(m)
    _positive(lora_rank=lora_rank)
    lora_module_names(m, lora_targets)  # every target exists in this block
    shapes = linear_shapes(m)
    return m.num_layers * sum(lora_rank * (shapes[t][0] + shapes[t][1])
                              for t in parse_lora_targets(lora_targets))


def linear_weight_bytes(m: ModelConfig, method: str, *, compute_dtype: str = "fp32") -> int:
    """The base's block linear weights as stored (biases and adapters not included): NF4 for
    qlora, int8 or int4 with their scales for lora_int8 and lora_int4, the compute dtype
    otherwise."""
    w = DTYPE_BYTES[_dtype_name(compute_dtype)]
    shapes = linear_shapes(m).values()
    scheme = BASE_FORMAT.get(method)
    if scheme == "nf4":
        return m.num_layers * sum(nf4_bytes(o, i, dtype=compute_dtype) for o, i in shapes)
    if scheme:
        return m.num_layers * sum(weight_only_bytes(o, i, scheme) for o, i in shapes)
    return m.num_layers * w * sum(o * i for o, i in shapes)


def finetune_compute_dtype(device: str | None = None) -> str:
    """bf16 where the device has native bf16 (torch.cuda.is_bf16_supported on a GPU, the CPU's
    avx512_bf16 / amx_bf16 flags), fp32 otherwise."""
    device = device or hardware.default_device()
    if device.startswith("cuda"):
        import torch

        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    return "bf16" if hardware.cpu_info().native_bf16 else "fp32"


def finetune_memory(m: ModelConfig, *, method: str, lora_rank: int = 8, lora_targets=("q", "v"),
                    batch_size: int, seq_len: int, compute_dtype: str = "fp32",
                    checkpointing: str = "none", device: str | None = None, zero_stage: int = 0,
                    gpus: int = 1, optimizer: str = "adamw", packed: bool = False,
                    loss_chunk: int = 0) -> MemoryPlan:
    """One fine-tuning step's memory on one of `gpus` data-parallel ranks (ZeRO `zero_stage`,
    2 and 3 as FSDP2 builds them: `_lora_sharded`). full: `training_memory` with every weight in
    the compute dtype (fp32, or pure bf16: weights, gradients and AdamW moments in 16 bits).
    lora / qlora / lora_int8 / lora_int4: the frozen base (block linears in the compute dtype,
    or as BASE_FORMAT stores them; the rest in the compute dtype) plus adapters in the compute
    dtype; gradients and AdamW state (two moments in the compute dtype: 8 B per trainable
    parameter in fp32, and a step counter per adapter tensor) for the adapters alone; the
    activations a frozen model still keeps (`_lora_layer_bytes`); a quantized base's
    dequantization buffer (`nf4_dequant_bytes` or `weight_only_dequant_bytes`, of the largest
    linear) at the backward's peak. checkpointing: none or full (each block keeps its input).
    `optimizer` adamw8bit / adamw4bit: the moments of each tensor large enough in low bits
    (`low_bit_state_bytes`), and their update's temporaries (`low_bit_update_bytes`). `packed`:
    documents packed into the rows, masked apart, and `loss_chunk`, the chunked loss (the head
    frozen: no weight gradient), as `training_memory`'s."""
    check_choice("finetune method", method, FINETUNE_METHODS)
    precision = {"float32": "fp32", "bfloat16": "bf16_pure",
                 "float16": "fp16_pure"}[_dtype_name(compute_dtype)]  # one dtype throughout
    if method == "full":
        plan = training_memory(m, batch_size=batch_size, seq_len=seq_len, precision=precision,
                               checkpointing=checkpointing, device=device, zero_stage=zero_stage,
                               gpus=gpus, fsdp2=True, optimizer=optimizer, packed=packed,
                               loss_chunk=loss_chunk)
        return dataclasses.replace(plan, trainable_params=plan.num_params,
                                   linear_weight_bytes=linear_weight_bytes(
                                       m, "full", compute_dtype=DTYPE_OF[precision]))
    check_choice("checkpointing (fine-tuning)", checkpointing, FINETUNE_CHECKPOINTING)
    r = _resolve(m, batch_size=batch_size, seq_len=seq_len, precision=precision,
                 checkpointing=checkpointing, device=device, zero_stage=zero_stage, gpus=gpus,
                 fsdp2=True, optimizer=optimizer, packed=packed, loss_chunk=loss_chunk)
    targets = parse_lora_targets(lora_targets)
    trainable = trainable_params(m, method, lora_rank=lora_rank, lora_targets=targets)
    return _lora_plan(r, method, targets, lora_rank, trainable)


def _lora_sharded(plan: MemoryPlan, r: _Run, method: str, trainable: int,
                  moments: tuple[int, int]) -> MemoryPlan:
    """A (Q)LoRA step's terms on one of `r.dp` ranks. ZeRO-1: AdamW's moments divided. ZeRO-2
    and 3 (FSDP2): every Parameter sharded at rest (the frozen embedding, head, norms and, for
    lora, block linears; the adapters), QLoRA's NF4 weights (buffers) kept whole on each rank;
    the adapters' gradients and moments sharded. In the backward FSDP2 holds gathered copies:
    ZeRO-2 every unit's (it does not reshard after forward), ZeRO-3 the root unit's (embedding,
    final norm, head: never resharded after forward) and two blocks' (the one in its backward
    and the next, prefetched), so under ZeRO-3 the loss's temporaries (the first of `moments`,
    the loss's and a block's) meet the root alone. Each micro-batch's forward starts with a third
    moment: FSDP2 gathers the root and the first block (prefetched) anew (both reshard after the
    backward), each all-gather's flat output beside the parameters it is copied into: twice
    their bytes."""
    m, w, dp = r.m, r.prec.weight, r.dp
    adam = 2 * w * trainable  # m and v; the steps, one per adapter tensor, are on every rank
    terms = {"optimizer": -(-adam // dp) + plan.optimizer_bytes - adam}
    formulas = {"optimizer": f"AdamW's m + v of the adapters / {dp} ranks (ZeRO-{r.zero_stage}), "
                             "+ 4 per adapter tensor (its step, on every rank)"}
    if r.zero_stage >= 2:
        linears = linear_weight_bytes(m, method, compute_dtype=DTYPE_OF[r.precision])
        elems = m.num_layers * block_linear_params(m, biases=False)
        dense = (r.num_params - elems) * w + w * trainable + (linears if method == "lora" else 0)
        root = w * _fsdp2_units(r)[0]
        block = (dense - root) // m.num_layers
        loss, in_block = moments
        terms.update(param=-(-dense // dp) + (linears if method in BASE_FORMAT else 0),
                     grad=-(-w * trainable // dp), forward_gathers=2 * (root + block))
        if r.zero_stage == 2:
            terms["gathered"] = dense
        else:  # the block's moment: the root and two blocks; the loss's: the root alone
            terms.update(gathered=root + 2 * block, backward_temporaries=max(loss - 2 * block, in_block))
        nf4 = (f" + the {BASE_FORMAT[method]} block linears whole (buffers)"
               if method in BASE_FORMAT else "")
        formulas.update(param=f"every Parameter (frozen base and adapters) / {dp} ranks{nf4}",
                        grad=f"the adapters' gradients / {dp} ranks",
                        gathered="FSDP2's whole parameters in the backward: every unit (ZeRO-2) "
                                 "or the root and two blocks (ZeRO-3)")
    plan = _phased(plan, **terms)
    return dataclasses.replace(plan, formulas={**plan.formulas, **formulas})


HELD = {"backward": ("param", "grad", "optimizer", "activation", "gathered"),
        "step": ("param", "grad", "optimizer"), "forward": ("param", "grad", "optimizer")}


def _phased(plan: MemoryPlan, *, forward_gathers: int = 0, backward_temporaries: int | None = None,
            **terms: int) -> MemoryPlan:
    """`plan` with `terms` replaced (by name: param, grad, optimizer, gathered), each phase's own
    temporaries kept (or the backward's given), and its peak chosen again; `forward_gathers`: the
    temporaries of a third phase, the start of a micro-batch's forward (FSDP2's first
    all-gathers)."""
    def held(p: MemoryPlan, phase: str) -> int:
        return sum(getattr(p, f"{t}_bytes") for t in HELD[phase])

    new = dataclasses.replace(plan, **{f"{k}_bytes": v for k, v in terms.items()})
    temporaries = {phase: plan.phase_bytes[phase] - held(plan, phase) for phase in ("backward", "step")}
    if backward_temporaries is not None:
        temporaries["backward"] = backward_temporaries
    temporaries["forward"] = forward_gathers
    phases = {phase: held(new, phase) + temporaries[phase] for phase in HELD}
    peak = max(phases, key=phases.get)
    return dataclasses.replace(new, phase_bytes=phases, peak_phase=peak, overhead_bytes=temporaries[peak],
                               held_at_peak=(*HELD[peak], "overhead"))


def _lora_plan(r: _Run, method: str, targets: tuple[str, ...], rank: int, trainable: int) -> MemoryPlan:
    """The terms of a (Q)LoRA step and its two phases (see `finetune_memory`)."""
    m, w, tokens = r.m, r.prec.weight, r.batch_size * r.seq_len
    linears = linear_weight_bytes(m, method, compute_dtype=DTYPE_OF[r.precision])
    elems = m.num_layers * block_linear_params(m, biases=False)
    param = (r.num_params - elems) * w + linears + w * trainable
    # AdamW's m and v in the adapters' dtype (or in low bits), its fp32 step counter per tensor
    adapters = [n for t in targets for o, i in [linear_shapes(m)[t]] for n in (rank * i, o * rank)] * m.num_layers
    low_bit = r.optimizer in LOW_BIT
    grad = w * trainable
    opt = (low_bit_state_bytes(adapters, r.optimizer) if low_bit else 2 * w * trainable) + 4 * len(adapters)
    act, per_layer = _lora_activations(r, targets, rank)
    dequant = max((_dequant_bytes(method, o, i, DTYPE_OF[r.precision])
                   for o, i in linear_shapes(m).values()), default=0)
    # under full checkpointing a block's backward first recomputes its forward: what the block
    # keeps without checkpointing is held again, one block at a time
    recomputed = tokens * _lora_layer_bytes(r, targets, rank, grad_in=True)[0] \
        if r.checkpointing == "full" else 0
    moments = _lora_backward_moments(r, tokens, dequant + recomputed)
    # the adapters' gradients are made in the blocks' backward: none yet at the loss's moment
    loss_moment, block_moment = moments
    with_grad = grad + block_moment >= loss_moment
    backward = block_moment if with_grad else loss_moment
    # torch's AdamW on the CPU loops (two temporaries of the largest adapter), on CUDA copies v
    largest = rank * max(o + i for o, i in linear_shapes(m).values())
    step = low_bit_update_bytes(adapters, r.optimizer, r.impl) if low_bit else \
        w * (2 * largest if r.impl == "single" else trainable)
    phases = {"backward": param + opt + act + grad * with_grad + backward, "step": param + opt + grad + step}
    peak = max(phases, key=phases.get)
    held = {"backward": ("param", "optimizer", "activation", "overhead") + (("grad",) if with_grad else ()),
            "step": ("param", "grad", "optimizer", "overhead")}[peak]
    plan = MemoryPlan(num_params=r.num_params + trainable, param_bytes=param, grad_bytes=grad,
                      optimizer_bytes=opt, activation_bytes=act, activation_bytes_per_layer=per_layer,
                      overhead_bytes=backward if peak == "backward" else step, held_at_peak=held,
                      peak_phase=peak, phase_bytes=phases, trainable_params=trainable,
                      linear_weight_bytes=linears)
    plan = dataclasses.replace(plan, formulas=_lora_formulas(r, method, targets, rank, dequant))
    return _lora_sharded(plan, r, method, trainable, moments) if r.dp > 1 and r.zero_stage >= 1 else plan


def _dequant_bytes(method: str, out_features: int, in_features: int, dtype: str) -> int:
    """One weight's dequantization for a matmul under `method` (0: the base is not quantized)."""
    scheme = BASE_FORMAT.get(method)
    if scheme == "nf4":
        return nf4_dequant_bytes(out_features, in_features, dtype=dtype)
    return weight_only_dequant_bytes(out_features, in_features, scheme, dtype=dtype) if scheme else 0


def _lora_activations(r: _Run, targets: tuple[str, ...], rank: int) -> tuple[int, int]:
    """(what the step holds, one layer's): every block (the first's input has no gradient: the
    embedding is frozen), or each block's input under full checkpointing; RoPE's tables; the
    final norm and the loss's log-probabilities."""
    tokens, m = r.batch_size * r.seq_len, r.m
    if r.checkpointing == "full":
        per_layer = tokens * r.prec.residual * r.shape.d
        layers = m.num_layers * per_layer + _document_mask_bytes(r, 0, m.num_layers)
    else:
        first, grad_out = _lora_layer_bytes(r, targets, rank, grad_in=False)
        per_layer = tokens * _lora_layer_bytes(r, targets, rank, grad_in=True)[0]
        layers = tokens * first + (m.num_layers - 1) * per_layer
        # every attention after the first keeps its inputs (and the mask's copy); the first's
        # only when an adapter on q, k or v trains through it
        attending = m.num_layers - (not set(targets) & {"q", "k", "v"})
        layers += _document_mask_bytes(r, attending, 0)
    # the final norm, and the loss's log-probabilities (b·s·V); chunked, one log-sum-exp per token
    # and the norm's output, which the chunks' backward needs (the frozen head's plain matmul
    # keeps no input: its weight needs no gradient)
    loss = 4 + r.prec.residual * r.shape.d if r.loss_chunk else 4 * r.shape.logits
    head = tokens * (_kept_norm_bytes(r) + loss + _target_copy_bytes(r)) + (0 if r.loss_chunk else 4)
    return layers + _embedding_side_bytes(r) + head, per_layer


def _kept_norm_bytes(r: _Run) -> int:
    """Per token, what a norm with a frozen weight keeps when its input needs a gradient:
    RMSNorm its fp32 input (4d) and rsqrt (4); LayerNorm its input, mean and rstd."""
    if r.m.arch == "llama":
        return 4 * r.shape.d + 4
    return r.prec.residual * r.shape.d + 2 * r.stat


def _adapter_inputs(r: _Run, targets: tuple[str, ...], width: int) -> int:
    """Per token, what the adapters on linears sharing one `width`-wide input keep of it: the
    input itself, once (the adapters share its dtype)."""
    return r.prec.act * width if targets else 0


def _lora_layer_bytes(r: _Run, targets: tuple[str, ...], rank: int, *, grad_in: bool) -> tuple[int, bool]:
    """(bytes per token one block keeps under (Q)LoRA, whether its output needs a gradient),
    walking the block in order; `grad_in`: whether its input needs one. Frozen linears keep
    nothing; an op keeps its inputs only when something upstream of it is trained."""
    s, a, T = r.shape, r.prec.act, set(targets)
    kept = (_kept_norm_bytes(r) if grad_in else 0) + _adapter_inputs(r, tuple(T & {"q", "k", "v"}), s.d)
    g_qkv = grad_in or bool(T & {"q", "k", "v"})
    kept += _attention_bytes(r) if g_qkv else 0  # SDPA's q, k, v, output, logsumexp
    if "o" in T:  # wo's input is SDPA's output: already kept when attention was
        kept += 0 if g_qkv else a * s.q
    g_mid = g_qkv or "o" in T
    first = "gate" if r.m.arch == "llama" else "up"
    kept += (_kept_norm_bytes(r) if g_mid else 0) + _adapter_inputs(r, tuple(T & {"gate", "up"}), s.d)
    if r.m.arch == "llama":  # silu keeps w1 x; the product keeps w3 x and silu(w1 x)
        g1, g3 = g_mid or "gate" in T, g_mid or "up" in T
        kept += a * s.f * (g1 + g1 + g3)
    else:  # GELU keeps its input
        g1 = g3 = g_mid or first in T
        kept += a * s.f * g1
    kept += _adapter_inputs(r, ("down",), s.f) if "down" in T else 0
    kept += len(T) * rank * a  # B keeps A x
    return kept, g_mid or g1 or g3 or "down" in T


def _lora_backward_moments(r: _Run, tokens: int, extra: int = 0) -> tuple[int, int]:
    """Beyond the activations, the temporaries of the backward's two largest moments: the
    loss's fp32 gradients of the log-probabilities and the logits (8·b·s·V), and a block's (the
    residual stream's gradient and the MLP's two f-wide gradients, beside `extra`: qlora's
    weight dequantized for its input's gradient, and a checkpointed block's recomputed
    activations)."""
    s, p = r.shape, r.prec
    loss = 8 * tokens * s.logits
    if r.loss_chunk:  # the frozen head: no weight gradient; the hidden states' and one chunk's
        c = min(r.loss_chunk, tokens)
        loss = p.residual * tokens * s.d + c * (4 * s.logits + 4 * s.d)
    block = tokens * (p.residual * s.d + (2 if r.m.arch == "llama" else 1) * p.act * s.f)
    return loss, block + extra


def _lora_formulas(r: _Run, method: str, targets: tuple[str, ...], rank: int, dequant: int) -> dict[str, str]:
    scheme = BASE_FORMAT.get(method)
    base = ("the base" if scheme is None else "NF4 block linears (nf4_bytes) + the rest"
            if scheme == "nf4" else f"{scheme} block linears (weight_only_bytes) + the rest")
    w = r.prec.weight
    return {"param": f"{base} in {r.precision} + {r.precision} adapters r·(in + out) per target, "
                     f"r = {rank}, targets {','.join(targets)}",
            "grad": f"{w}·Ψ_trainable (the adapters only, in {r.precision}; the base is frozen)",
            "optimizer": (f"{r.optimizer}'s m + v of the adapters (low_bit_state_bytes: in "
                          f"{LOW_BIT[r.optimizer].bits} bits where a tensor has >= 4096 elements) "
                          "+ 4 per adapter tensor (its step)") if r.optimizer in LOW_BIT else
                         (f"{2 * w}·Ψ_trainable + 4 per adapter tensor (AdamW m + v in {r.precision} "
                          "and its fp32 step, adapters only)"),
            "activation": "frozen layers still keep norms, attention's q/k/v/output and the MLP's "
                          "activation inputs; + each adapter's input and A x (r wide)",
            "overhead": "backward: max(loss 8·b·s·V, a block's gradients"
                        + (f" + one weight's dequantization ({dequant:,} B))" if dequant else ")")}


def finetune_frontier(m: ModelConfig, *, gpu_mem_bytes: int, seq_len: int, lora_rank: int = 8,
                      lora_targets=("q", "v"), compute_dtype: str = "bf16",
                      device: str | None = "cuda") -> list[dict]:
    """For each method, without and with full checkpointing: the longest sequence that fits
    `gpu_mem_bytes` at micro-batch 1 (bisection up to the model's context; 0: none fits) and
    the largest micro-batch at `seq_len` (doubling, then bisection; 0: none fits)."""
    out = []
    for method in FINETUNE_METHODS:
        for ckpt in FINETUNE_CHECKPOINTING:
            def total(b: int, s: int, method=method, ckpt=ckpt) -> int:
                return finetune_memory(m, method=method, lora_rank=lora_rank, lora_targets=lora_targets,
                                       batch_size=b, seq_len=s, compute_dtype=compute_dtype,
                                       checkpointing=ckpt, device=device).total_bytes
            longest = _largest_fitting(lambda s: total(1, s) <= gpu_mem_bytes, m.max_seq_len)
            batch = _largest_fitting(lambda b: total(b, seq_len) <= gpu_mem_bytes, None)
            out.append({"method": method, "checkpointing": ckpt, "max_seq_len": longest,
                        "max_micro_batch": batch, "seq_len": seq_len,
                        "total_bytes_at_max_seq": total(1, longest) if longest else None})
    return out


def _largest_fitting(fits, limit: int | None, cap: int = 2**16) -> int:
    """The largest n in 1..limit (or 1..cap, doubling first) with fits(n), for a monotone
    fits; 0 when even 1 does not fit."""
    if not fits(1):
        return 0
    hi = limit or cap
    if fits(hi):
        return hi
    lo = 1
    if limit is None:  # grow: the first power of two that does not fit bounds the search
        while lo * 2 < hi and fits(lo * 2):
            lo *= 2
        hi = min(lo * 2, hi)
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
