"""The analytic model: the napkin math that experiments show beside their measurements.

Counts follow the model in `labkit.blocks.model` exactly (the tests hold them to the module's own
parameter count and to FlopCounterMode), so a gap between predicted and measured is a finding.

The second half is the memory planner: `training_memory` (what one training step holds per GPU
and its peak), `kv_cache_bytes` and `inference_memory`, `recommend` (the cheapest plan that
fits) and `plan_report` (all of it for `labkit plan` and the notebook), with the papers' own
formulas beside them (`zero_model_state_bytes`, `korthikanti_activation_bytes`).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from labkit import hardware
from labkit.config import DTYPE_BYTES, MODELS, PRESETS, ConfigError, ModelConfig, check_choice


def block_linear_params(m: ModelConfig, *, biases: bool = True) -> int:
    """Weights (and biases) of the linear layers of one block; the weights alone are what the
    matmuls multiply by (bias adds are not counted as FLOPs)."""
    hd, gpt2 = m.head_dim, m.arch == "gpt2"
    q_o = 2 * m.hidden_size * m.num_heads * hd
    k_v = 2 * m.hidden_size * m.num_kv_heads * hd
    mlp = (3 if m.arch == "llama" else 2) * m.hidden_size * m.ffn_size
    if not biases:
        return q_o + k_v + mlp
    qkv = (m.num_heads + 2 * m.num_kv_heads) * hd if gpt2 or m.qkv_bias else 0  # Qwen2: these alone
    rest = 2 * m.hidden_size + m.ffn_size if gpt2 else 0  # wo, w1, w2
    return q_o + k_v + mlp + qkv + rest


def num_params(m: ModelConfig) -> int:
    """All parameters, tied embeddings counted once."""
    norm = m.hidden_size * (2 if m.arch == "gpt2" else 1)  # LayerNorm has a bias
    embed = m.vocab_size * m.hidden_size
    positions = m.max_seq_len * m.hidden_size if m.arch == "gpt2" else 0
    head = 0 if m.tie_embeddings else embed
    return embed + positions + head + m.num_layers * (block_linear_params(m) + 2 * norm) + norm


def param_bytes(m: ModelConfig, dtype: str) -> int:
    return num_params(m) * DTYPE_BYTES[dtype]


def adamw_state_bytes(m: ModelConfig, *, master_copy: bool = False) -> int:
    """AdamW keeps two fp32 moments per parameter (plus an fp32 master copy when the weights are
    held in 16 bits): K of `optimizer_bytes_per_param`. The per-tensor step counters are a few
    bytes and left out."""
    return num_params(m) * optimizer_bytes_per_param("mixed" if master_copy else "fp32", "adamw")


def attention_flops(m: ModelConfig, *, batch: int, new: int, keys: int) -> int:
    """Scores and weighted sum, 2 * 2 * new * keys * head_dim per head and layer. The full
    new x keys matrix counts, as FlopCounterMode counts SDPA (causal masking does not halve it)."""
    return batch * 4 * new * keys * m.num_layers * m.num_heads * m.head_dim


def forward_flops(m: ModelConfig, *, batch: int, new: int, keys: int, logits: int) -> int:
    """FLOPs of one forward pass over `new` tokens attending to `keys` positions, projecting
    `logits` positions to the vocabulary (multiply-add = 2)."""
    blocks = 2 * new * m.num_layers * block_linear_params(m, biases=False)
    head = 2 * logits * m.hidden_size * m.vocab_size
    return batch * (blocks + head) + attention_flops(m, batch=batch, new=new, keys=keys)


def train_step_flops(m: ModelConfig, *, batch: int, seq_len: int, attention: str = "sdpa") -> int:
    """Forward + backward: the matmuls cost 2x forward again (the familiar 6 * N * tokens);
    attention's backward is 2x its forward with plain matmuls, 2.5x with SDPA, whose fused
    backward recomputes the scores (5 matmuls)."""
    attn = attention_flops(m, batch=batch, new=seq_len, keys=seq_len)
    rest = forward_flops(m, batch=batch, new=seq_len, keys=seq_len, logits=seq_len) - attn
    return 3 * rest + attn * (7 if attention == "sdpa" else 6) // 2


def kv_bytes_per_token(m: ModelConfig, dtype: str) -> int:
    """One token's keys and values across all layers: 2 * layers * kv_heads * head_dim * bytes."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * DTYPE_BYTES[dtype]


def generate_flops(m: ModelConfig, *, batch: int, prompt_len: int, new_tokens: int,
                   cached: bool) -> int:
    """Greedy decoding of `new_tokens`: with a cache, a prefill then one token per step; without,
    the whole prefix again every step (only its last position projected to logits)."""
    if not cached:
        return sum(forward_flops(m, batch=batch, new=prompt_len + i, keys=prompt_len + i, logits=1)
                   for i in range(new_tokens))
    prefill = forward_flops(m, batch=batch, new=prompt_len, keys=prompt_len, logits=1)
    return prefill + sum(forward_flops(m, batch=batch, new=1, keys=prompt_len + i, logits=1)
                         for i in range(1, new_tokens))


# ==================================================================================================
# Training memory: what one training step holds per GPU, and what fits.
#
# Three sources, each term derived from shapes, never fitted to a measurement:
# - model states per ZeRO stage (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
#   Trillion Parameter Models", section 3.1 and figure 1);
# - activations per layer, the analysis of Korthikanti et al. 2022, "Reducing Activation
#   Recomputation in Large Transformer Models" (section 4), redone for the blocks of
#   `labkit.blocks.model` (see `layer_activation_bytes`); the paper's own formulas are
#   `korthikanti_activation_bytes`;
# - the step's timeline: which of these coexist at the peak (`training_memory`).
# ==================================================================================================

PRECISIONS = ("fp32", "fp16", "bf16", "mixed", "bf16_autocast", "fp16_autocast")
OPTIMIZERS = ("adam", "adamw", "sgd")
CHECKPOINTING = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)
OPTIMIZER_IMPLS = ("single", "foreach", "fused")
GIB = 2**30
_count_params = num_params  # `num_params` is also a keyword of the functions below


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of each thing a training step keeps, for one precision recipe."""

    weight: int  # the weights the model computes with
    grad: int  # their gradients
    moment: int  # one optimizer moment (Adam's m or v, SGD's momentum)
    master: int  # an fp32 master copy of the weights kept by the optimizer (0: none)
    act: int  # activations (where the model does not upcast on purpose)
    cast: int = 0  # autocast: bytes of its 16-bit compute dtype (0: no autocast)

    @property
    def residual(self) -> int:
        """The residual stream's (and the norms') dtype: fp32 under autocast, which leaves adds
        and norms to the weights' dtype; the activation dtype otherwise."""
        return 4 if self.cast else self.act


PRECISION_BYTES = {
    "fp32": PrecisionBytes(weight=4, grad=4, moment=4, master=0, act=4),
    # Pure 16-bit: weights, gradients and optimizer moments all in 16 bits, no master copy.
    "fp16": PrecisionBytes(weight=2, grad=2, moment=2, master=0, act=2),
    "bf16": PrecisionBytes(weight=2, grad=2, moment=2, master=0, act=2),
    # ZeRO's mixed precision: 16-bit weights and gradients, fp32 master weights and moments:
    # 2 + 2 + K with K = 12 for Adam (master 4 + m 4 + v 4), 16 bytes per parameter.
    "mixed": PrecisionBytes(weight=2, grad=2, moment=4, master=4, act=2),
    # Autocast (torch.autocast) over fp32 weights, fp32 gradients and fp32 AdamW: the matmuls'
    # inputs and outputs (and SDPA's) in 16 bits, the residual stream and the norms in fp32, and
    # a cached 16-bit copy of every matmul weight (`_weight_casts`). Not "bf16": that is pure
    # 16-bit training.
    "bf16_autocast": PrecisionBytes(weight=4, grad=4, moment=4, master=0, act=2, cast=2),
    "fp16_autocast": PrecisionBytes(weight=4, grad=4, moment=4, master=0, act=2, cast=2),
}
DTYPE_OF = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "mixed": "bfloat16",
            "bf16_autocast": "bfloat16", "fp16_autocast": "float16"}


def optimizer_bytes_per_param(precision: str, optimizer: str) -> int:
    """K in ZeRO's notation: the optimizer's bytes per parameter. Adam/AdamW keep two moments
    (m, v); SGD with momentum keeps one buffer; a mixed-precision recipe adds the fp32 master copy.
    (K = 12 for mixed-precision Adam, as in the ZeRO paper.)"""
    p = PRECISION_BYTES[check_choice("precision", precision, PRECISIONS)]
    moments = 1 if check_choice("optimizer", optimizer, OPTIMIZERS) == "sgd" else 2
    return p.master + moments * p.moment


def zero_model_state_bytes(num_params: int, *, stage: int, dp: int, precision: str = "mixed",
                           optimizer: str = "adam") -> tuple[int, int, int]:
    """(param, grad, optimizer) bytes per GPU for Ψ = num_params under ZeRO `stage` over `dp`
    data-parallel ranks. With mixed-precision Adam (2 + 2 + K, K = 12), the paper's figure 1:
    stage 0 (2+2+K)Ψ; stage 1 (P_os) 2Ψ + 2Ψ + KΨ/Nd; stage 2 (P_os+g) 2Ψ + (2+K)Ψ/Nd;
    stage 3 (P_os+g+p) (2+2+K)Ψ/Nd. A shard is rounded up to whole elements."""
    p = PRECISION_BYTES[check_choice("precision", precision, PRECISIONS)]
    if stage not in ZERO_STAGES:
        raise ConfigError(f"zero_stage={stage} is not a ZeRO stage; valid: 0, 1, 2, 3")
    shard = -(-num_params // dp)
    k = optimizer_bytes_per_param(precision, optimizer)
    return (p.weight * (shard if stage >= 3 else num_params),
            p.grad * (shard if stage >= 2 else num_params),
            k * (shard if stage >= 1 else num_params))


def korthikanti_activation_bytes(*, s: int, b: int, h: int, a: int, L: int = 1, t: int = 1,
                                 sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes of L layers of the paper's GPT block (fp16 activations, 1-byte dropout
    masks, softmax scores stored), table 2 of Korthikanti et al. 2022: per layer
    no recomputation sbh(34 + 5as/h) with t = 1, sbh(10 + 24/t + 5as/(ht)) with tensor
    parallelism, sbh(34/t + 5as/(ht)) with sequence parallelism too; selective recomputation
    (the attention core a·s² terms recomputed) sbh(10 + 24/t), or sbh(34/t) with sequence
    parallelism; full recomputation 2sbh (each layer's fp16 input). s sequence, b micro-batch,
    h hidden size, a heads, t tensor-parallel size."""
    sbh = s * b * h
    # softmax output 2as²b, its dropout mask as²b, the dropout's output 2as²b
    attention_core = 5 * a * s * s * b / t
    if recompute == "full":
        return 2 * sbh * L
    rest = 34 * sbh / t if sequence_parallel else sbh * (10 + 24 / t)
    if recompute == "selective":
        return rest * L
    if recompute != "none":
        raise ConfigError(f"unknown recompute {recompute!r}; valid: none, selective, full")
    return (rest + attention_core) * L


# --- The model's shapes on one GPU ---------------------------------------------------------------

@dataclass(frozen=True)
class LocalShape:
    """One layer's widths on one tensor-parallel rank (Megatron's split: attention heads and the
    MLP's inner width are divided; norms, the residual stream and d-wide outputs are not)."""

    d: int  # hidden size (replicated)
    q: int  # query width = local heads x head_dim
    kv: int  # key (= value) width = local kv heads x head_dim
    f: int  # MLP inner width
    heads: int  # local query heads
    vocab: int  # local vocabulary (vocab-parallel embedding, head and cross-entropy)


def local_shape(m: ModelConfig, tp: int = 1) -> LocalShape:
    """Widths on one of `tp` ranks. kv heads split when tp divides them; with fewer kv heads than
    ranks each rank keeps one (Megatron replicates them)."""
    check_tp(m, tp)
    kv_heads = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1
    return LocalShape(d=m.hidden_size, q=m.num_heads // tp * m.head_dim, kv=kv_heads * m.head_dim,
                      f=-(-m.ffn_size // tp), heads=m.num_heads // tp, vocab=-(-m.vocab_size // tp))


def check_tp(m: ModelConfig, tp: int) -> None:
    if m.num_heads % tp:
        raise ConfigError(f"tp={tp} does not divide the model's {m.num_heads} attention heads")
    if m.num_kv_heads % tp and tp % m.num_kv_heads:
        raise ConfigError(f"tp={tp} and the model's {m.num_kv_heads} kv heads: one must divide the other")


@dataclass(frozen=True)
class StageParams:
    """Parameters one GPU holds for one pipeline stage (its tensor-parallel shard)."""

    total: int
    largest_tensor: int
    largest_pair: int  # max over consecutive parameters of previous + 2 x current (see _step_temporaries)
    largest_unit: int  # the biggest module ZeRO-3 gathers at once (a layer, the embedding, the head)
    num_layers: int


def block_tensors(m: ModelConfig, s: LocalShape) -> list[int]:
    """Sizes of one block's parameters on one rank, in the module's order (attn_norm, mlp_norm,
    wq, wk, wv, wo, w1, [w3], w2; each Linear's bias after its weight). Column-parallel weights
    (wq, wk, wv, w1, w3) and their biases split; row-parallel ones (wo, w2) split, their biases
    replicated; norms replicated. Qwen2's q, k, v biases (qkv_bias) split with their weights."""
    if m.arch == "llama" and m.qkv_bias:
        return [s.d, s.d, s.d * s.q, s.q, s.d * s.kv, s.kv, s.d * s.kv, s.kv, s.q * s.d, s.d * s.f,
                s.d * s.f, s.f * s.d]
    if m.arch == "llama":
        return [s.d, s.d, s.d * s.q, s.d * s.kv, s.d * s.kv, s.q * s.d, s.d * s.f, s.d * s.f, s.f * s.d]
    return [s.d, s.d, s.d, s.d, s.d * s.q, s.q, s.d * s.kv, s.kv, s.d * s.kv, s.kv, s.q * s.d, s.d,
            s.d * s.f, s.f, s.f * s.d, s.d]


def layer_params(m: ModelConfig, s: LocalShape) -> tuple[int, int]:
    """(parameters, largest tensor) of one block on one rank."""
    sizes = block_tensors(m, s)
    return sum(sizes), max(sizes)


def stage_tensors(m: ModelConfig, *, tp: int = 1, pp: int = 1, first: bool = True,
                  last: bool = True) -> list[int]:
    """Sizes of the parameters the `first` and/or `last` pipeline stage holds, in the module's
    order: the embedding (first; GPT-2's learned positions too), ceil(L/pp) blocks, the final norm
    and the head (last; a tied head is the embedding itself when both are on one stage, a copy
    otherwise, as Megatron does)."""
    s = local_shape(m, tp)
    norm = [s.d] * (2 if m.arch == "gpt2" else 1)
    head = [] if m.tie_embeddings and first else [s.vocab * s.d]
    out = ([s.vocab * s.d] + ([m.max_seq_len * s.d] if m.arch == "gpt2" else [])) if first else []
    out += block_tensors(m, s) * -(-m.num_layers // pp)
    return out + (norm + head if last else [])


def stage_params(m: ModelConfig, *, tp: int = 1, pp: int = 1, first: bool = True,
                 last: bool = True) -> StageParams:
    """What one stage holds, as totals (see `stage_tensors`)."""
    sizes = stage_tensors(m, tp=tp, pp=pp, first=first, last=last)
    s, layers = local_shape(m, tp), -(-m.num_layers // pp)
    embed = s.vocab * s.d + (m.max_seq_len * s.d if m.arch == "gpt2" else 0)
    head = s.d * (2 if m.arch == "gpt2" else 1) + s.vocab * s.d
    pairs = [prev + 2 * cur for prev, cur in zip([0] + sizes, sizes)]
    return StageParams(total=sum(sizes), largest_tensor=max(sizes), largest_pair=max(pairs),
                       num_layers=layers, largest_unit=max(layer_params(m, s)[0],
                                                           embed if first else 0, head if last else 0))


# --- Activations: what our blocks keep for backward, per token -----------------------------------

def layer_activation_bytes(m: ModelConfig, *, batch_size: int, seq_len: int, precision: str = "fp32",
                           tp: int = 1, checkpointing: str = "none", device: str | None = None) -> int:
    """Bytes one block of `labkit.blocks.model` keeps for backward at (batch_size, seq_len), read off
    what autograd saves (SavedTensorMeter.by_producer) and checked against it in the tests.

    How this differs from the paper's GPT block (34sbh + 5as²b, fp16, `korthikanti_activation_bytes`):
    - no dropout, so no 1-byte masks (the paper's 2sbh per layer plus as²b);
    - flash-style attention (SDPA) keeps its output and the fp32 logsumexp (b·heads·s), never the
      a·s² score matrix: the 5as²b term becomes 4·a·s·b bytes;
    - Llama: RMSNorm computes in fp32 on purpose, so each norm keeps an fp32 copy of its input and
      its fp32 rsqrt (b·s), then the normalised value and the output in the activation dtype;
      RoPE is computed in fp32 but keeps only its (activation-dtype) result, which SDPA saves;
      grouped-query attention's k and v are kv_heads·head_dim wide, not h; SwiGLU keeps four
      f-wide tensors (w1 x, silu(w1 x), w3 x, their product) instead of GELU's two 4h-wide ones;
    - GPT-2: LayerNorm keeps its input and its mean and rstd (b·s each: fp32 on CUDA, the input's
      dtype on the CPU); q, k, v, the attention output and GELU's input and output as in the paper;
    - selective recomputation keeps what `SAVED_BY_SELECTIVE` marks (every matmul's output and
      SDPA's), not the paper's "all but the attention core"; full keeps the block's input.
    Tensor parallelism divides the head- and f-wide terms; the norms' are replicated, as in the
    paper's sbh(10 + 24/t + ...)."""
    run = _resolve(m, batch_size=batch_size, seq_len=seq_len, precision=precision, tp=tp,
                   gpus=tp, checkpointing=checkpointing, device=device)
    return batch_size * seq_len * _layer_bytes_per_token(run, run.checkpointing)


def _norm_bytes(r: "_Run", consumers: int = 1) -> int:
    """Per token, one norm: what it keeps for backward plus its output (the next matmul's input).
    Under autocast the output stays fp32 and is not kept: each of its `consumers` (the matmuls
    it feeds) saves its own 16-bit cast of it (autocast caches only the weights' casts)."""
    s, n = r.shape, r.prec.residual
    out = consumers * r.prec.cast * s.d if r.prec.cast else r.prec.act * s.d
    if r.m.arch == "llama":  # x32 (4d, the input itself in fp32), rsqrt (4), x·rsqrt (n·d), output
        return 4 * s.d + 4 + n * s.d + out
    return n * s.d + out + 2 * r.stat  # input (n·d), output, mean and rstd


def _attention_bytes(r: "_Run") -> int:
    """Per token: SDPA's inputs q, k, v (after RoPE), its output (wo's input) and logsumexp (fp32)."""
    s, a = r.shape, r.prec.act
    return a * (s.q + 2 * s.kv) + a * s.q + 4 * s.heads


def _mlp_bytes(r: "_Run") -> int:
    """Per token: SwiGLU keeps w1 x, silu(w1 x), w3 x and their product (w2's input); GELU keeps
    its input and output."""
    return (4 if r.m.arch == "llama" else 2) * r.prec.act * r.shape.f


def _selective_bytes(r: "_Run") -> int:
    """Per token, a selectively recomputed block: its input, every matmul's output (wq, wk, wv,
    wo, w1, [w3], w2; wo's and w2's are d wide on every rank) and SDPA's output and logsumexp."""
    s, a = r.shape, r.prec.act
    mlp = (2 if r.m.arch == "llama" else 1) * s.f + s.d
    return r.prec.residual * s.d + a * (s.q + 2 * s.kv + s.d + mlp + s.q) + 4 * s.heads


def _layer_bytes_per_token(r: "_Run", mode: str) -> int:
    if mode == "full":
        return r.prec.residual * r.shape.d  # the block's input, held by torch.utils.checkpoint
    if mode == "selective":
        return _selective_bytes(r)
    # the attention norm feeds wq, wk and wv; the MLP norm w1 and w3 (SwiGLU) or w1 (GELU)
    mlp_inputs = 2 if r.m.arch == "llama" else 1
    return _norm_bytes(r, 3) + _norm_bytes(r, mlp_inputs) + _attention_bytes(r) + _mlp_bytes(r)


def _embedding_side_bytes(r: "_Run") -> int:
    """Per micro-batch on the first stage: RoPE's cos and sin tables (s x head_dim each, fp32,
    built once per forward and held by every layer's backward), or GPT-2's int64 positions
    (saved by the position embedding)."""
    if r.m.arch == "llama":
        return 2 * r.seq_len * r.m.head_dim * 4
    return 8 * r.seq_len


def _head_bytes(r: "_Run") -> int:
    """Per micro-batch on the last stage: the final norm (as a block's), cross-entropy's fp32
    log-probabilities (b·s·V, kept by log_softmax for its backward; the logits themselves are
    freed), the int64 targets nll_loss keeps, and its fp32 total_weight scalar."""
    tokens = r.batch_size * r.seq_len
    return tokens * (_norm_bytes(r) + 4 * r.shape.vocab + 8) + 4


# --- The plan -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryPlan:
    """What one training step holds on one GPU, in bytes. `total_bytes` is the predicted peak: the
    sum of the terms in `held_at_peak` (gradients and activations do not coexist in full: the
    gradients are allocated in backward as the activations are freed; see `training_memory`)."""

    num_params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int  # per GPU, over the layers (and micro-batches in flight) it holds
    activation_bytes_per_layer: int  # one layer, one micro-batch, under the chosen checkpointing
    overhead_bytes: int  # what else the peak holds (loss/optimizer temporaries, working buffers)
    kv_cache_bytes: int = 0
    weight_copy_bytes: int = 0  # autocast's 16-bit weight casts held at the peak (autocast cases)
    gathered_bytes: int = 0  # FSDP2's ZeRO-2: the whole parameters held beside the shards
    kept_weight_copy_bytes: int = 0  # autocast's casts the backward keeps (saved for it)
    held_at_peak: tuple[str, ...] = ("param", "grad", "optimizer", "activation", "overhead", "kv_cache")
    peak_phase: str = ""  # where the peak is: "backward" or "step" (the optimizer step)
    phase_bytes: dict = field(default_factory=dict, compare=False)  # each phase's predicted peak
    formulas: dict = field(default_factory=dict, compare=False)  # term -> how it was computed
    stage: str = "all"  # the pipeline stage described: all, first or last
    trainable_params: int = 0  # fine-tuning (`finetune_memory`): parameters the optimizer updates
    linear_weight_bytes: int = 0  # fine-tuning: the base's block linear weights as stored

    @property
    def model_states_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return sum(getattr(self, f"{term}_bytes") for term in self.held_at_peak)


@dataclass(frozen=True)
class _Run:
    """Validated inputs of one plan, with what follows from them."""

    m: ModelConfig | None
    num_params: int
    batch_size: int
    seq_len: int
    precision: str
    prec: PrecisionBytes
    optimizer: str
    zero_stage: int
    tp: int
    pp: int
    dp: int
    checkpointing: str
    checkpointed_layers: int | None
    accumulation_steps: int
    impl: str  # the optimizer's implementation: torch's default for the device unless given
    fsdp2: bool  # ZeRO stages 2-3 as FSDP2 builds them (shards kept beside gathered parameters)
    stat: int  # bytes of LayerNorm's mean/rstd: fp32 on CUDA, the activation dtype on the CPU
    shape: LocalShape | None


def _positive(**values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name}={value!r} must be a positive integer")


def _resolve(m: ModelConfig | None = None, *, num_params: int | None = None, batch_size: int = 1,
             seq_len: int = 2048, precision: str = "fp32", optimizer: str = "adamw",
             zero_stage: int = 0, tp: int = 1, pp: int = 1, gpus: int = 1,
             checkpointing: str = "none", checkpointed_layers: int | None = None,
             accumulation_steps: int = 1, device: str | None = None,
             optimizer_impl: str | None = None, fsdp2: bool = False) -> _Run:
    """Check every input (ConfigError naming the valid choices) and derive the rest."""
    _positive(batch_size=batch_size, seq_len=seq_len, tp=tp, pp=pp, gpus=gpus,
              accumulation_steps=accumulation_steps)
    check_choice("precision", precision, PRECISIONS), check_choice("optimizer", optimizer, OPTIMIZERS)
    check_choice("checkpointing", checkpointing, CHECKPOINTING)
    if zero_stage not in ZERO_STAGES:
        raise ConfigError(f"zero_stage={zero_stage!r} is not a ZeRO stage; valid: 0, 1, 2, 3")
    if gpus % (tp * pp):
        raise ConfigError(f"gpus={gpus} is not a multiple of tp x pp = {tp * pp}")
    psi = _check_model(m, num_params, seq_len=seq_len, tp=tp, pp=pp)
    _check_checkpointed(m, checkpointing, checkpointed_layers)
    device = device or hardware.default_device()
    impl = optimizer_impl or ("single" if device.startswith("cpu") else "foreach")
    check_choice("optimizer_impl", impl, OPTIMIZER_IMPLS)
    p = PRECISION_BYTES[precision]
    return _Run(m=m, num_params=psi, batch_size=batch_size, seq_len=seq_len, precision=precision,
                prec=p, optimizer=optimizer, zero_stage=zero_stage, tp=tp, pp=pp,
                dp=gpus // (tp * pp), checkpointing=checkpointing,
                checkpointed_layers=checkpointed_layers, accumulation_steps=accumulation_steps,
                impl=impl, fsdp2=fsdp2, stat=p.residual if device.startswith("cpu") else 4,
                shape=local_shape(m, tp) if m is not None else None)


def _check_model(m: ModelConfig | None, num_params: int | None, *, seq_len: int, tp: int,
                 pp: int) -> int:
    """Ψ, from the shape or as given (exactly one of them)."""
    if m is None:
        if num_params is None:
            raise ConfigError("give a model shape or num_params")
        _positive(num_params=num_params)
        return num_params
    if num_params is not None and num_params != _count_params(m):
        raise ConfigError("give a model shape or num_params, not both")
    if pp > m.num_layers:
        raise ConfigError(f"pp={pp} pipeline stages for {m.num_layers} layers: at most one stage per layer")
    if seq_len > m.max_seq_len:
        raise ConfigError(f"seq_len={seq_len} is longer than the model's context ({m.max_seq_len})")
    check_tp(m, tp)
    return _count_params(m)


def _check_checkpointed(m: ModelConfig | None, mode: str, layers: int | None) -> None:
    if layers is None:
        return
    total = m.num_layers if m is not None else layers
    if not isinstance(layers, int) or not 0 <= layers <= total:
        raise ConfigError(f"checkpointed_layers={layers!r} must be between 0 and {total}")
    if mode == "none" and layers:
        raise ConfigError("checkpointed_layers needs checkpointing selective or full")


def training_memory(m: ModelConfig | None = None, *, num_params: int | None = None,
                    batch_size: int = 1, seq_len: int = 2048, precision: str = "fp32",
                    optimizer: str = "adamw", zero_stage: int = 0, tp: int = 1, pp: int = 1,
                    gpus: int = 1, checkpointing: str = "none",
                    checkpointed_layers: int | None = None, accumulation_steps: int = 1,
                    device: str | None = None, optimizer_impl: str | None = None,
                    fsdp2: bool = False) -> MemoryPlan:
    """Predict one training step's memory on one GPU (the busiest pipeline stage when pp > 1).

    The step, as `labkit.blocks.training.Trainer` runs it (zero_grad(set_to_none=True)):
    the weights and optimizer states stay resident; the forward builds the activations; the
    backward starts with the loss's temporaries on top of all of them and allocates gradients
    while it frees activations; the optimizer step holds every gradient plus its temporaries.
    The peak is the larger of the backward's start and the optimizer step (`peak_phase`), so
    `total_bytes` is params + optimizer + max(activations + backward temporaries, gradients +
    step temporaries); with `accumulation_steps` > 1 or pp > 1 the gradients of earlier
    micro-batches are held through the backward too.

    `checkpointed_layers` (None: all) recompute with `checkpointing`, the rest keep everything.
    `device` ("cpu", "cuda"; None: this machine's default) picks torch's default optimizer
    implementation, as `torch.optim` does: a for-loop on the CPU ("single": two temporaries the
    size of the largest parameter), multi-tensor on CUDA ("foreach": a copy of every moment v);
    `optimizer_impl` overrides it ("fused": none). With only `num_params` (no shape), the model
    states and the optimizer step are predicted, split evenly over tp x pp.

    `precision` bf16_autocast / fp16_autocast: autocast over fp32 weights, fp32 gradients and
    fp32 AdamW (not "bf16", pure 16-bit training): the matmuls' activations in 16 bits, the
    residual stream and the norms in fp32, and autocast's cached 16-bit weight copies
    (`weight_copy_bytes`): all of them at the end of the forward, a third phase ("forward"),
    and those the backward keeps at its start. `fsdp2`: ZeRO stage 2 as FSDP2 builds it
    (`gathered_bytes`: the whole parameters beside the shards between the passes)."""
    r = _resolve(m, num_params=num_params, batch_size=batch_size, seq_len=seq_len,
                 precision=precision, optimizer=optimizer, zero_stage=zero_stage, tp=tp, pp=pp,
                 gpus=gpus, checkpointing=checkpointing, checkpointed_layers=checkpointed_layers,
                 accumulation_steps=accumulation_steps, device=device, optimizer_impl=optimizer_impl,
                 fsdp2=fsdp2)
    if r.m is None:
        psi = -(-r.num_params // (tp * pp))
        return _stage_plan(r, StageParams(psi, psi, 2 * psi, psi, 0), "all", first=False, last=False)
    stages = [("all", True, True)] if pp == 1 else [("first", True, False), ("last", False, True)]
    plans = [_stage_plan(r, stage_params(r.m, tp=tp, pp=pp, first=first, last=last), name,
                         first=first, last=last) for name, first, last in stages]
    return max(plans, key=lambda plan: plan.total_bytes)


def _stage_plan(r: _Run, sp: StageParams, stage: str, *, first: bool, last: bool) -> MemoryPlan:
    param, grad, opt = zero_model_state_bytes(sp.total, stage=r.zero_stage, dp=r.dp,
                                              precision=r.precision, optimizer=r.optimizer)
    # FSDP2's ZeRO-2 (reshard_after_forward=False): at rest only the shards; from each unit's
    # forward to its backward the whole parameters beside them (the paper's stage 2 keeps them
    # whole always: `param`, then, is what the step holds between the passes, less the shards).
    gathered = 0
    if r.fsdp2 and r.zero_stage == 2 and r.dp > 1:
        gathered, param = param, r.prec.weight * -(-sp.total // r.dp)
    act, per_layer = _stage_activations(r, sp, first, last) if r.m is not None else (0, 0)
    # Gradients allocated through the whole backward: earlier micro-batches' (accumulation,
    # pipelining), or DDP's all-reduce buckets (stages 0 and 1), which live as long as the model.
    resident = r.accumulation_steps > 1 or r.pp > 1 or (r.dp > 1 and r.zero_stage < 2)
    held_grad = grad if resident else 0
    # FSDP2 accumulates into the gradient shards: each micro-batch's backward makes every unit's
    # whole gradients anew, as without accumulation, and reduce-scatters them into the shards.
    fresh = not resident or (r.fsdp2 and r.zero_stage >= 2 and r.dp > 1 and r.pp == 1)
    backward = _backward_temporaries(r, sp, last, not fresh) if r.m is not None else 0
    # DDP accumulating under no_sync: the earlier micro-batches' gradients are plain tensors
    # beside the buckets until the last backward copies them in (measured on gloo ranks), through
    # the later micro-batches' forwards and backwards alike
    no_sync = grad if r.dp > 1 and r.zero_stage < 2 and r.accumulation_steps > 1 else 0
    backward += no_sync
    casts, kept_casts = _weight_casts(r, sp, last) if r.m is not None else (0, 0)
    step = _step_temporaries(r, sp)
    phases = {"backward": param + gathered + opt + act + kept_casts + backward + held_grad,
              "step": param + opt + grad + step}
    # The forward's largest moment: its end under autocast (every cast cached until the loss),
    # or its start under FSDP2's ZeRO-3 (the first units' all-gathers in flight)
    at_end = act + casts + _forward_temporaries(r, last) if casts else 0
    at_start = _fsdp2_forward_gathers(r) if r.m is not None and last else 0
    if at_end or at_start:
        phases["forward"] = param + gathered + opt + held_grad + no_sync + max(at_end, at_start)
    peak = max(phases, key=phases.get)
    starts = peak == "forward" and at_start > at_end
    with_grad = ("grad",) if resident else ()
    held = {"backward": ("param", "gathered", "optimizer", "activation", "weight_copy", "overhead") + with_grad,
            "forward": ("param", "gathered", "optimizer") + (() if starts else ("activation", "weight_copy"))
            + ("overhead",) + with_grad,
            "step": ("param", "grad", "optimizer", "overhead")}[peak]
    overhead = {"backward": backward, "step": step,
                "forward": (at_start if starts else at_end - act - casts) + no_sync}[peak]
    plan = MemoryPlan(num_params=r.num_params, param_bytes=param, grad_bytes=grad,
                      optimizer_bytes=opt, activation_bytes=act,
                      activation_bytes_per_layer=per_layer, overhead_bytes=overhead,
                      weight_copy_bytes=casts if peak == "forward" else kept_casts,
                      gathered_bytes=gathered, kept_weight_copy_bytes=kept_casts, held_at_peak=held, peak_phase=peak,
                      phase_bytes=phases, stage=stage)
    return dataclasses.replace(plan, formulas=_formulas(r, sp, plan, first))


def _matmul_weights(s: LocalShape, arch: str) -> int:
    """Elements of one block's matmul weights on one rank (what autocast casts)."""
    return 2 * s.d * s.q + 2 * s.d * s.kv + (3 if arch == "llama" else 2) * s.d * s.f


def _weight_casts(r: _Run, sp: StageParams, last: bool) -> tuple[int, int]:
    """Autocast's 16-bit copies of the matmul weights (cast once per forward and cached for it,
    also in checkpointed blocks and for FSDP2's gathered units): (all of them, held until the
    forward ends; those the backward keeps: the plain blocks' and the head's, since a
    checkpointed block casts again when it recomputes). 0 without autocast."""
    if not r.prec.cast:
        return 0, 0
    block = _matmul_weights(r.shape, r.m.arch)
    head = r.shape.vocab * r.shape.d if last else 0
    k = _checkpointed_on_stage(r, sp.num_layers)
    return (r.prec.cast * (sp.num_layers * block + head),
            r.prec.cast * ((sp.num_layers - k) * block + head))


def _forward_temporaries(r: _Run, last: bool) -> int:
    """At the end of an autocast forward, while log_softmax writes its output (an activation):
    the 16-bit logits and their fp32 copy (b·s·V each), which the loss alone holds."""
    if not last:
        return 0
    return (r.prec.cast + 4) * r.batch_size * r.seq_len * r.shape.vocab


def _checkpointed_on_stage(r: _Run, layers: int) -> int:
    """Recomputed layers on this stage: all, or a share of `checkpointed_layers` rounded down (the
    busiest stage recomputes the fewest)."""
    if r.checkpointing == "none":
        return 0
    if r.checkpointed_layers is None:
        return layers
    return r.checkpointed_layers * layers // r.m.num_layers


def _stage_activations(r: _Run, sp: StageParams, first: bool, last: bool) -> tuple[int, int]:
    """(activation bytes the stage holds, one layer's). With 1F1B pipelining stage i holds
    pp - i micro-batches in flight (the paper's section 4.2.3): pp on the first, one on the last."""
    tokens = r.batch_size * r.seq_len
    k = _checkpointed_on_stage(r, sp.num_layers)
    recomputed = tokens * _layer_bytes_per_token(r, r.checkpointing)
    plain = tokens * _layer_bytes_per_token(r, "none")
    layers = k * recomputed + (sp.num_layers - k) * plain
    in_flight = r.pp if first else 1
    total = in_flight * (layers + (_embedding_side_bytes(r) if first else 0))
    return total + (_head_bytes(r) if last else 0), recomputed


def _backward_temporaries(r: _Run, sp: StageParams, last: bool, resident: bool) -> int:
    """What the backward holds beyond the activations at its largest moment, per GPU. The
    candidates, in the order the backward meets them:
    - loss: log_softmax's backward holds the fp32 gradients of the log-probabilities and of the
      logits (b·s·V each) while its saved output is still held: 8·b·s·V;
    - head: the head's matmul backward makes its weight's gradient (V·d) and its input's (b·s·d)
      while the logits' gradient (a·b·s·V) lives and the log-probabilities are gone;
    - the first and the last block it goes through (`_block_backward`): by then the head's
      activations are freed, its gradients made, and the residual stream's gradient (a·b·s·d)
      flows down; each block frees its activations and makes its gradients, so the running sum
      is largest at one end;
    - ZeRO working buffers: stage 3 gathers one module's full weights at a time, stages 2-3 hold
      one module's full gradient until it is reduce-scattered."""
    tokens, s, p = r.batch_size * r.seq_len, r.shape, r.prec
    loss = head = 0
    after_head = p.residual * tokens * s.d  # the residual stream's gradient
    if last:
        head_grad = 0 if resident else p.grad * s.vocab * s.d
        loss = 8 * tokens * s.vocab
        head = head_grad + p.act * tokens * s.d + (p.act - 4) * tokens * s.vocab
        after_head += head_grad - _head_bytes(r)
    first, per_block = _block_backward(r, sp, resident)
    # the j-th block the backward goes through: j blocks finished before it
    blocks = max(after_head + first + j * per_block + _zero_buffers(r, sp, last, resident, j)
                 for j in range(sp.num_layers))
    return max(max(0, loss, head) + _zero_buffers(r, sp, last, resident, None), blocks)


def _zero_buffers(r: _Run, sp: StageParams, last: bool, resident: bool, block: int | None) -> int:
    """ZeRO's working buffers at the loss and the head (`block` None) or in the backward's
    `block`-th block (0: the first it goes through): stage 3 gathers one module's full weights
    at a time, stages 2-3 hold one module's full gradient until it is reduce-scattered; FSDP2
    as `_fsdp2_buffers` says."""
    if r.dp == 1:
        return 0
    if r.fsdp2 and last and not resident and r.pp == 1:
        return _fsdp2_buffers(r, block, sp.num_layers)
    p = r.prec
    return ((p.weight if r.zero_stage >= 3 else 0) + (p.grad if r.zero_stage >= 2 else 0)) * sp.largest_unit


def _fsdp2_units(r: _Run) -> tuple[int, int]:
    """(the root unit's parameters, one block's): FSDP2's units as `apply_data_parallel` shards
    them. The root unit is the embedding, the final norm and the head (both V·d matrices unless
    tied; GPT-2's learned positions too)."""
    s, gpt2 = r.shape, r.m.arch == "gpt2"
    root = s.vocab * s.d * (1 if r.m.tie_embeddings else 2) + s.d * (2 if gpt2 else 1) \
        + (r.m.max_seq_len * s.d if gpt2 else 0)
    return root, layer_params(r.m, s)[0]


def _fsdp2_buffers(r: _Run, block: int | None, num_layers: int) -> int:
    """FSDP2's ZeRO-3 working buffers in a backward, whose micro-batch makes every unit's whole
    gradients anew (with or without accumulation), at the loss and the head (`block` None) or
    in the `block`-th block. The root unit stays gathered from its forward to the end of the
    backward (FSDP2 does not reshard the root after forward). In a block: that block gathered;
    the next one's all-gather output, already allocated (backward prefetch), unless it is the
    last; the previous block's reduce-scatter input, unless it is the first (FSDP2 frees it at
    the next reduce-scatter rather than record it on a stream). The unsharded gradients are the
    head's (`head_grad`) and each block's (`_block_backward`). Measured on gloo ranks (tiny, 2
    and 4 layers, with and without recomputation and accumulation): within 0.2% of the peak;
    tied embeddings without accumulation 2.4% above it."""
    if r.zero_stage < 3:
        return 0
    root, layer = _fsdp2_units(r)
    if block is None:
        return r.prec.weight * root
    return r.prec.weight * (root + layer * (1 + (block < num_layers - 1) + (block > 0)))


def _fsdp2_forward_gathers(r: _Run) -> int:
    """FSDP2's ZeRO-3 all-gathers as a forward starts: the root unit's flat all-gather output
    beside the unsharded parameters it is copied out to, and the same for the first block
    (forward prefetch). The largest moment of the forward when the activations are small
    (recomputation) and the gradient shards of earlier micro-batches are held. 0 elsewhere."""
    if not (r.fsdp2 and r.zero_stage >= 3 and r.dp > 1 and r.pp == 1):
        return 0
    root, layer = _fsdp2_units(r)
    return 2 * r.prec.weight * (root + layer)


def _block_backward(r: _Run, sp: StageParams, resident: bool) -> tuple[int, int]:
    """(the most one block's backward adds, how much each finished block adds): a checkpointed
    block first runs its forward again and holds what a plain block keeps (less what it shares
    with what was kept: `_recompute_overlap`); its MLP's backward then holds w2's new weight
    gradient and, at the product's (GELU's) backward, two (one) more f-wide gradients than the
    saved tensors it has freed. A finished block has freed its activations and made its gradients:
    whole ones, or under FSDP2 only their shard (the whole ones are reduce-scattered and freed),
    which an earlier micro-batch has already made when accumulating."""
    tokens, s, p = r.batch_size * r.seq_len, r.shape, r.prec
    k = _checkpointed_on_stage(r, sp.num_layers)
    plain = tokens * _layer_bytes_per_token(r, "none")
    kept = tokens * _layer_bytes_per_token(r, r.checkpointing) if k else plain
    recompute = plain - tokens * _recompute_overlap(r) if k else 0
    recompute += p.cast * _matmul_weights(s, r.m.arch) if k else 0  # autocast's casts again
    w2_grad = 0 if resident else p.grad * s.d * s.f
    live = (2 if r.m.arch == "llama" else 1) * p.act * tokens * s.f
    grads = 0 if resident else p.grad * layer_params(r.m, s)[0]
    if r.fsdp2 and r.zero_stage >= 2 and r.dp > 1:
        grads = 0 if r.accumulation_steps > 1 else -(-grads // r.dp)
    held = (k * kept + (sp.num_layers - k) * plain) // sp.num_layers
    return recompute + w2_grad + live, grads - held


def _recompute_overlap(r: _Run) -> int:
    """Per token, what a recomputed block shares with what it kept: its input (the norm's input
    itself in fp32 Llama and in GPT-2); with selective recomputation also the cached matmul and
    SDPA outputs a plain block keeps (v, SDPA's output and logsumexp, w1 x [and w3 x]; GPT-2's
    q and k too). An upper bound: torch's selective checkpointing frees some recomputed tensors
    early."""
    s, a, llama = r.shape, r.prec.act, r.m.arch == "llama"
    overlap = (4 * s.d if r.prec.residual == 4 else 0) if llama else r.prec.residual * s.d
    if r.checkpointing == "selective":
        matmuls = a * s.kv + (2 * a * s.f if llama else a * (s.q + s.kv + s.f))
        overlap += matmuls + a * s.q + 4 * s.heads
    return overlap


def _step_temporaries(r: _Run, sp: StageParams) -> int:
    """The optimizer step's temporaries, over the parameters this GPU's optimizer updates (its
    ZeRO shard from stage 1): a mixed-precision step first makes fp32 copies of the 16-bit
    gradients (4 bytes each) for the master weights; Adam then needs sqrt(v) / sqrt(1 - β2^t):
    torch's for-loop makes two temporaries per parameter while the previous parameter's
    denominator is still bound (so previous + 2 x current, at the largest pair), the multi-tensor
    version one copy of every v, the fused kernel none. SGD's momentum updates in place."""
    shard = (lambda n: -(-n // r.dp)) if r.zero_stage >= 1 else (lambda n: n)
    upcast = 4 * shard(sp.total) if r.prec.master else 0
    if r.optimizer == "sgd":
        return upcast
    adam = {"single": r.prec.moment * shard(sp.largest_pair),
            "foreach": r.prec.moment * shard(sp.total), "fused": 0}[r.impl]
    return upcast + adam


# --- Formulas, in words, for the table ------------------------------------------------------------

_LAYER_FORMULAS = {  # per token; a = activation bytes, d/q/kv/f/h = local widths
    ("llama", "none"): "2·(4d + 4 + 2a·d) + a·(2q + 2kv) + 4h + 4a·f",
    ("gpt2", "none"): "2·(2a·d + 2σ) + a·(2q + 2kv) + 4h + 2a·f",
    ("llama", "selective"): "a·(3d + 2q + 2kv + 2f) + 4h",
    ("gpt2", "selective"): "a·(3d + 2q + 2kv + f) + 4h",
    ("llama", "full"): "a·d", ("gpt2", "full"): "a·d",
}


def _formulas(r: _Run, sp: StageParams, plan: MemoryPlan, first: bool) -> dict[str, str]:
    """How each term was computed, for the human table."""
    nd = f"/Nd (Nd = {r.dp})"
    k = optimizer_bytes_per_param(r.precision, r.optimizer)
    out = {"param": f"{r.prec.weight}·Ψ{nd if r.zero_stage >= 3 else ''}, Ψ = {sp.total:,} here",
           "grad": f"{r.prec.grad}·Ψ{nd if r.zero_stage >= 2 else ''}",
           "optimizer": f"K·Ψ{nd if r.zero_stage >= 1 else ''}, K = {k} ({_k_words(r)})",
           "overhead": _overhead_words(r, plan)}
    if r.m is None:
        out["activation"] = "no model shape given (only --params): not predicted"
        return out
    s = r.shape
    widths = f"a={r.prec.act} d={s.d} q={s.q} kv={s.kv} f={s.f} h={s.heads}"
    k = _checkpointed_on_stage(r, sp.num_layers)
    layers = f"{k} layers × b·s·[{_LAYER_FORMULAS[(r.m.arch, r.checkpointing)]}]" if k else ""
    plain = sp.num_layers - k
    layers += (" + " if k and plain else "") + (
        f"{plain} layers × b·s·[{_LAYER_FORMULAS[(r.m.arch, 'none')]}]" if plain else "")
    flight = f"{r.pp} micro-batches in flight × " if first and r.pp > 1 else ""
    out["activation"] = (f"{flight}({layers}) ({widths}) + embedding/head/loss; Korthikanti et "
                         "al.'s analysis redone for this block")
    return out


def _k_words(r: _Run) -> str:
    moments = "momentum" if r.optimizer == "sgd" else "m + v"
    master = "fp32 master + " if r.prec.master else ""
    return f"{master}{moments} in {'fp32' if r.prec.moment == 4 else '16 bits'}"


def _overhead_words(r: _Run, plan: MemoryPlan) -> str:
    if plan.peak_phase == "backward":
        return ("backward: the largest of the loss's fp32 gradients (8·b·s·V), the head's "
                "gradients, a block's backward (its recomputed forward, w2's gradient and the "
                "MLP's f-wide gradients) + ZeRO working buffers")
    upcast = "fp32 copy of the gradients (4·Ψ_opt) + " if r.prec.master else ""
    adam = {"single": "2 temporaries per parameter, the largest pair (for-loop Adam)",
            "foreach": "one copy of v (multi-tensor Adam)", "fused": "none (fused Adam)"}[r.impl]
    return f"optimizer step: {upcast}{'nothing (SGD)' if r.optimizer == 'sgd' else adam}"


# --- Inference: the KV cache -----------------------------------------------------------------------

def kv_cache_bytes(m: ModelConfig, *, batch_size: int, seq_len: int, precision: str = "bf16",
                   tp: int = 1, pp: int = 1) -> int:
    """The KV cache one GPU holds for `batch_size` sequences of `seq_len` tokens:
    kv_bytes_per_token x batch x sequence, with the kv heads split over tp (one each when there
    are fewer than tp) and the layers over pp. Stored in the weights' dtype."""
    s = local_shape(m, tp)
    layers = -(-m.num_layers // pp)
    return 2 * layers * s.kv * DTYPE_BYTES[DTYPE_OF[precision]] * batch_size * seq_len


def inference_memory(m: ModelConfig, *, batch_size: int = 1, seq_len: int = 2048,
                     precision: str = "bf16", tp: int = 1, pp: int = 1) -> MemoryPlan:
    """Serving at (batch, seq): the weights (16 bits for mixed) and the KV cache, per GPU. The
    prefill's transient activations are not counted."""
    _positive(batch_size=batch_size, seq_len=seq_len, tp=tp, pp=pp)
    _check_model(m, None, seq_len=seq_len, tp=tp, pp=pp)
    sp = stage_params(m, tp=tp, pp=pp, first=True, last=pp == 1)
    weights = sp.total * PRECISION_BYTES[check_choice("precision", precision, PRECISIONS)].weight
    kv = kv_cache_bytes(m, batch_size=batch_size, seq_len=seq_len, precision=precision, tp=tp, pp=pp)
    return MemoryPlan(num_params=_count_params(m), param_bytes=weights, grad_bytes=0,
                      optimizer_bytes=0, activation_bytes=0, activation_bytes_per_layer=0,
                      overhead_bytes=0, kv_cache_bytes=kv,
                      held_at_peak=("param", "kv_cache"), peak_phase="decode")


# --- Recommendation: the cheapest plan that fits ---------------------------------------------------

# Tried in order, cheapest first. ZeRO stages 1-2 move the same bytes as plain data parallelism
# (2Ψ per step, the ZeRO paper's section 7), so they come before any recomputation; stage 3 moves
# 1.5x that on every step, so it comes last; selective recomputation (elementwise ops again) comes
# before full (a whole extra forward).
_SEARCH = tuple((ckpt, zero) for ckpt in CHECKPOINTING for zero in (0, 1, 2)) + \
    tuple((ckpt, 3) for ckpt in CHECKPOINTING)
# mixed first (fp32 master weights: the standard recipe); pure bf16 halves the optimizer state
# at some cost in accuracy, so it is the fallback.
_RECOMMENDED_PRECISIONS = ("mixed", "bf16")


@dataclass(frozen=True)
class Recommendation:
    """A plan for `effective_batch` sequences per optimizer step: micro_batch x
    accumulation_steps x data-parallel ranks. `fits` is False when nothing tried fits (then the
    fields describe the smallest plan tried)."""

    precision: str
    checkpointing: str
    zero_stage: int
    micro_batch: int
    accumulation_steps: int
    effective_batch: int
    total_bytes: int
    fits: bool
    reason: str


def recommend(m: ModelConfig | None = None, *, num_params: int | None = None,
              effective_batch: int, seq_len: int = 2048, gpus: int = 1, gpu_mem_bytes: int,
              tp: int = 1, pp: int = 1, optimizer: str = "adamw", device: str | None = "cuda",
              optimizer_impl: str | None = None) -> Recommendation:
    """The first plan that fits, trying precisions, then (checkpointing, ZeRO stage) pairs in the
    order of `_SEARCH`, each at the largest micro-batch that divides the batch per rank."""
    _positive(effective_batch=effective_batch, gpu_mem_bytes=gpu_mem_bytes, gpus=gpus, tp=tp, pp=pp)
    dp = gpus // (tp * pp) or 1
    if effective_batch % dp:
        raise ConfigError(f"effective batch {effective_batch} is not a multiple of the {dp} "
                          "data-parallel ranks")
    per_rank = effective_batch // dp
    kw = dict(num_params=num_params, seq_len=seq_len, optimizer=optimizer, tp=tp, pp=pp,
              gpus=gpus, device=device, optimizer_impl=optimizer_impl)
    smallest = None
    for precision in _RECOMMENDED_PRECISIONS:
        for ckpt, zero in _SEARCH:
            if zero and dp == 1 or ckpt != "none" and m is None:
                continue  # ZeRO needs data parallelism; recomputation needs a shape
            plan, micro = _largest_micro_batch(m, per_rank, gpu_mem_bytes, precision=precision,
                                               checkpointing=ckpt, zero_stage=zero, **kw)
            rec = Recommendation(precision, ckpt, zero, micro, per_rank // micro, effective_batch,
                                 plan.total_bytes, plan.total_bytes <= gpu_mem_bytes, "")
            if rec.fits:
                return dataclasses.replace(rec, reason=_why(rec, dp))
            smallest = min(smallest or rec, rec, key=lambda x: x.total_bytes)
    return dataclasses.replace(smallest, reason=(
        "nothing tried fits: more GPUs, more tensor/pipeline parallelism, a shorter sequence or "
        "CPU offload are needed; this is the smallest plan tried"))


def _largest_micro_batch(m, per_rank: int, gpu_mem_bytes: int, **kw) -> tuple[MemoryPlan, int]:
    """The largest divisor of `per_rank` whose plan fits (else micro-batch 1), and its plan."""
    for micro in sorted((n for n in range(1, per_rank + 1) if per_rank % n == 0), reverse=True):
        plan = training_memory(m, batch_size=micro, accumulation_steps=per_rank // micro, **kw)
        if plan.total_bytes <= gpu_mem_bytes:
            return plan, micro
    return plan, 1


def _why(rec: Recommendation, dp: int) -> str:
    parts = [f"{rec.precision} precision",
             "no recomputation" if rec.checkpointing == "none" else f"{rec.checkpointing} recomputation",
             f"ZeRO stage {rec.zero_stage}" if dp > 1 else "one data-parallel rank",
             f"micro-batch {rec.micro_batch} x {rec.accumulation_steps} accumulation step(s) x {dp} rank(s)"]
    return "cheapest plan that fits: " + ", ".join(parts)


# ==================================================================================================
# Fine-tuning: full, LoRA and QLoRA on one GPU.
#
# - LoRA (Hu et al. 2021) as PEFT builds it: each targeted nn.Linear W (out x in) gets A (r x in)
#   and B (out x r), output W x + (alpha / r) B A x; the base is frozen (no gradients, no optimizer
#   state). The adapters are in the compute dtype, as the base (labkit.blocks.lora passes
#   autocast_adapter_dtype=False: PEFT's default would upcast 16-bit adapters to fp32), so are
#   their gradients and AdamW's two moments (torch keeps them in the parameter's dtype), beside
#   one fp32 step counter per adapter tensor.
# - QLoRA (Dettmers et al. 2023) as torchao's NF4Tensor stores it: the block linears' weights in
#   4 bits with int8 absmax scalers per `block_size` values, double-quantized (one factor per
#   scaler block); the embedding, the norms and the head stay in the compute dtype. The paper's
#   arithmetic: fp32 scales per 64 weights cost 32/64 = 0.5 bits per weight, 8-bit scales with
#   fp32 second-level scales per 256 cost 8/64 + 32/(64·256) = 0.127.
# - A frozen linear saves nothing for backward (the input's gradient needs only the weight), so
#   what LoRA keeps is what the adapters and the non-linear ops need: the norms, attention's
#   inputs and output, the MLP's activation inputs; `_lora_layer_bytes` walks a block in order
#   (checked exactly against saved-tensor hooks on PEFT's model in the tests).
# ==================================================================================================

FINETUNE_METHODS = ("full", "lora", "qlora")
LORA_TARGET_NAMES = ("q", "k", "v", "o", "gate", "up", "down")
LORA_TARGET_ALIASES = {"attn": ("q", "k", "v", "o"), "all": LORA_TARGET_NAMES}
# labkit's module names (labkit.blocks.model): SwiGLU is w2(silu(w1 x) * w3 x); GPT-2's MLP is
# w2(gelu(w1 x)), so its first linear is "up" and it has no gate.
LORA_MODULES = {"llama": {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w1", "up": "w3", "down": "w2"},
                "gpt2": {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "up": "w1", "down": "w2"}}
FINETUNE_CHECKPOINTING = ("none", "full")
NF4_BLOCK_SIZE = 64  # weights per int8 absmax scaler (the QLoRA paper's and torchao's default)
NF4_SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)  # torchao's default first: 256


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


def nf4_scaler_block(numel: int, block_size: int = NF4_BLOCK_SIZE) -> int:
    """The scaler block size for one weight: the largest of 256, 128, ..., 1 that divides its
    number of blocks (torchao asserts that it divides). ConfigError when `block_size` does not
    divide `numel`."""
    _positive(numel=numel, block_size=block_size)
    if numel % block_size or numel % 2:
        raise ConfigError(f"a weight of {numel} elements does not split into NF4 blocks of "
                          f"{block_size} (valid: an even number of elements divisible by it)")
    blocks = numel // block_size
    return next(n for n in NF4_SCALER_BLOCKS if blocks % n == 0)


def nf4_bytes(out_features: int, in_features: int, *, block_size: int = NF4_BLOCK_SIZE,
              double_quant: bool = True, dtype: str = "fp32") -> int:
    """One weight as NF4 stores it. double_quant (torchao's NF4Tensor, quantized from a `dtype`
    weight): 4-bit codes two per byte, an int8 scaler per block, one `dtype` factor per scaler
    block (`nf4_scaler_block`; with a single scaler block torchao keeps a view of a whole
    scaler-block-long tensor, so that many), the scalers' mean and the 16-entry code book, both
    in `dtype`. Without double quantization (the QLoRA paper's baseline, not a torchao option):
    codes plus one fp32 absmax per block."""
    numel = out_features * in_features
    sb = nf4_scaler_block(numel, block_size)
    blocks, w = numel // block_size, DTYPE_BYTES[_dtype_name(dtype)]
    if not double_quant:
        return numel // 2 + 4 * blocks
    factors = blocks // sb if blocks // sb > 1 else blocks
    return numel // 2 + blocks + w * factors + w + 16 * w


def nf4_dequant_bytes(out_features: int, in_features: int, *, dtype: str = "fp32",
                      block_size: int = NF4_BLOCK_SIZE) -> int:
    """The peak of torchao's dequantization of one weight (get_original_weight, in forward and
    again in backward): two int64 code tensors (numel/2 each: 8·numel), the two looked-up halves
    and their scaled copies (w·numel/2 each), the stacked weight (w·numel) and the dequantized
    scalers (w per block); measured with LiveTensorTracker in the tests."""
    numel, w = out_features * in_features, DTYPE_BYTES[_dtype_name(dtype)]
    return numel * (8 + 3 * w) + w * (numel // block_size)


def _dtype_name(dtype: str) -> str:
    from labkit.config import DTYPE_ALIASES

    return DTYPE_ALIASES[check_choice("compute dtype", dtype, tuple(DTYPE_ALIASES))]


def linear_weight_bytes(m: ModelConfig, method: str, *, compute_dtype: str = "fp32") -> int:
    """The base's block linear weights as stored (biases and adapters not included): NF4 for
    qlora, the compute dtype otherwise."""
    w = DTYPE_BYTES[_dtype_name(compute_dtype)]
    shapes = linear_shapes(m).values()
    if method == "qlora":
        return m.num_layers * sum(nf4_bytes(o, i, dtype=compute_dtype) for o, i in shapes)
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
                    checkpointing: str = "none", device: str | None = None) -> MemoryPlan:
    """One fine-tuning step's memory on one GPU. full: `training_memory` with every weight in
    the compute dtype (fp32, or pure bf16: weights, gradients and AdamW moments in 16 bits).
    lora / qlora: the frozen base (block linears in the compute dtype, or NF4 for qlora; the
    rest in the compute dtype) plus adapters in the compute dtype; gradients and AdamW state
    (two moments in the compute dtype: 8 B per trainable parameter in fp32, and a step counter
    per adapter tensor) for the adapters alone; the activations a frozen model still keeps
    (`_lora_layer_bytes`); qlora's dequantization buffer (`nf4_dequant_bytes`, the largest
    linear) at the backward's peak. checkpointing: none or full (each block keeps its input)."""
    check_choice("finetune method", method, FINETUNE_METHODS)
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[_dtype_name(compute_dtype)]
    if method == "full":
        plan = training_memory(m, batch_size=batch_size, seq_len=seq_len, precision=precision,
                               checkpointing=checkpointing, device=device)
        return dataclasses.replace(plan, trainable_params=plan.num_params,
                                   linear_weight_bytes=linear_weight_bytes(m, "full", compute_dtype=precision))
    check_choice("checkpointing (fine-tuning)", checkpointing, FINETUNE_CHECKPOINTING)
    r = _resolve(m, batch_size=batch_size, seq_len=seq_len, precision=precision,
                 checkpointing=checkpointing, device=device)
    targets = parse_lora_targets(lora_targets)
    trainable = trainable_params(m, method, lora_rank=lora_rank, lora_targets=targets)
    return _lora_plan(r, method, targets, lora_rank, trainable)


def _lora_plan(r: _Run, method: str, targets: tuple[str, ...], rank: int, trainable: int) -> MemoryPlan:
    """The terms of a (Q)LoRA step and its two phases (see `finetune_memory`)."""
    m, w, tokens = r.m, r.prec.weight, r.batch_size * r.seq_len
    linears = linear_weight_bytes(m, method, compute_dtype=r.precision)
    elems = m.num_layers * block_linear_params(m, biases=False)
    param = (r.num_params - elems) * w + linears + w * trainable
    # AdamW's m and v in the adapters' dtype, and its fp32 step counter per tensor (A and B)
    grad, opt = w * trainable, 2 * w * trainable + 4 * 2 * len(targets) * m.num_layers
    act, per_layer = _lora_activations(r, targets, rank)
    dequant = max(nf4_dequant_bytes(o, i, dtype=r.precision) for o, i in linear_shapes(m).values()) \
        if method == "qlora" else 0
    backward = _lora_backward_temporaries(r, tokens, dequant)
    # torch's AdamW on the CPU loops (two temporaries of the largest adapter), on CUDA copies v
    largest = rank * max(o + i for o, i in linear_shapes(m).values())
    step = w * (2 * largest if r.impl == "single" else trainable)
    phases = {"backward": param + opt + act + grad + backward, "step": param + opt + grad + step}
    peak = max(phases, key=phases.get)
    held = {"backward": ("param", "grad", "optimizer", "activation", "overhead"),
            "step": ("param", "grad", "optimizer", "overhead")}[peak]
    plan = MemoryPlan(num_params=r.num_params + trainable, param_bytes=param, grad_bytes=grad,
                      optimizer_bytes=opt, activation_bytes=act, activation_bytes_per_layer=per_layer,
                      overhead_bytes=backward if peak == "backward" else step, held_at_peak=held,
                      peak_phase=peak, phase_bytes=phases, trainable_params=trainable,
                      linear_weight_bytes=linears)
    return dataclasses.replace(plan, formulas=_lora_formulas(r, method, targets, rank, dequant))


def _lora_activations(r: _Run, targets: tuple[str, ...], rank: int) -> tuple[int, int]:
    """(what the step holds, one layer's): every block (the first's input has no gradient: the
    embedding is frozen), or each block's input under full checkpointing; RoPE's tables; the
    final norm and the loss's log-probabilities."""
    tokens, m = r.batch_size * r.seq_len, r.m
    if r.checkpointing == "full":
        per_layer = tokens * r.prec.residual * r.shape.d
        layers = m.num_layers * per_layer
    else:
        first, grad_out = _lora_layer_bytes(r, targets, rank, grad_in=False)
        per_layer = tokens * _lora_layer_bytes(r, targets, rank, grad_in=True)[0]
        layers = tokens * first + (m.num_layers - 1) * per_layer
    head = tokens * (_kept_norm_bytes(r) + 4 * r.shape.vocab + 8) + 4  # norm, log-probs, targets
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


def _lora_backward_temporaries(r: _Run, tokens: int, dequant: int = 0) -> int:
    """Beyond the activations at the backward's largest moment: the loss's fp32 gradients of
    the log-probabilities and the logits (8·b·s·V), or a block's (the residual stream's
    gradient and the MLP's two f-wide gradients, beside qlora's `dequant`: a weight
    dequantized for its input's gradient), whichever is larger."""
    s, p = r.shape, r.prec
    loss = 8 * tokens * s.vocab
    block = tokens * (p.residual * s.d + (2 if r.m.arch == "llama" else 1) * p.act * s.f)
    return max(loss, block + dequant)


def _lora_formulas(r: _Run, method: str, targets: tuple[str, ...], rank: int, dequant: int) -> dict[str, str]:
    base = "NF4 block linears (nf4_bytes) + the rest" if method == "qlora" else "the base"
    w = r.prec.weight
    return {"param": f"{base} in {r.precision} + {r.precision} adapters r·(in + out) per target, "
                     f"r = {rank}, targets {','.join(targets)}",
            "grad": f"{w}·Ψ_trainable (the adapters only, in {r.precision}; the base is frozen)",
            "optimizer": f"{2 * w}·Ψ_trainable + 4 per adapter tensor (AdamW m + v in {r.precision} "
                         "and its fp32 step, adapters only)",
            "activation": "frozen layers still keep norms, attention's q/k/v/output and the MLP's "
                          "activation inputs; + each adapter's input and A x (r wide)",
            "overhead": "backward: max(loss 8·b·s·V, a block's gradients"
                        + (f" + one weight's NF4 dequantization ({dequant:,} B))" if dequant else ")")}


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


# --- The whole answer, as `labkit plan` and the notebook show it ----------------------------------

def plan_report(*, model: str | ModelConfig | None = None, params: float | str | None = None,
                batch_size: int = 1, seq_len: int | None = None, precision: str = "mixed",
                optimizer: str = "adamw", optimizer_impl: str = "foreach", zero_stage: int = 0,
                tp: int = 1, pp: int = 1, gpus: int | None = None, gpu_mem_gib: float = 80.0,
                checkpointing: str = "none", effective_batch: int | None = None,
                finetune: str | None = None, lora_rank: int = 8, lora_alpha: float = 16.0,
                lora_targets: str | tuple = "q,v") -> dict:
    """One JSON-safe answer for a GPU run: the per-GPU terms of the step at `batch_size` sequences
    per micro-batch, whether it fits `gpu_mem_gib`, the KV cache for serving at the same batch and
    sequence, and the cheapest plan that fits `effective_batch` sequences per optimizer step.
    `model` is a preset (default `tiny`) or a ModelConfig (e.g. read from a Hugging Face
    config.json by `labkit.blocks.hf.model_config`); `params` a bare parameter count instead.
    `finetune` (full, lora, qlora): the step is `finetune_memory`'s on one GPU, in the compute
    dtype `precision` implies (fp32 for fp32, fp16 for fp16, bf16 otherwise), with
    `trainable_params` at the top level, `finetune` (its settings) and `finetune_frontier`;
    `lora_alpha` scales the update, not the memory."""
    m, psi, name = _model_or_params(model, params)
    if seq_len is None:
        seq_len = min(2048, m.max_seq_len) if m else 2048
    gpus = tp * pp if gpus is None else gpus
    mem = _gpu_mem_bytes(gpu_mem_gib)
    _positive(batch_size=batch_size, tp=tp, pp=pp, gpus=gpus)
    effective_batch, accumulation = _accumulation(batch_size, effective_batch, gpus // (tp * pp) or 1)
    common = dict(num_params=None if m else psi, seq_len=seq_len, optimizer=optimizer, tp=tp,
                  pp=pp, gpus=gpus, device="cuda", optimizer_impl=optimizer_impl)
    if finetune is not None:
        ft = _finetune_settings(m, finetune, precision, lora_rank, lora_alpha, lora_targets,
                                tp=tp, pp=pp, gpus=gpus, zero_stage=zero_stage, accumulation=accumulation)
        plan = finetune_memory(m, method=finetune, lora_rank=lora_rank, lora_targets=ft["lora_targets"],
                               batch_size=batch_size, seq_len=seq_len, compute_dtype=ft["compute_dtype"],
                               checkpointing=checkpointing, device="cuda")
    else:
        plan = training_memory(m, batch_size=batch_size, precision=precision, zero_stage=zero_stage,
                               checkpointing=checkpointing, accumulation_steps=accumulation, **common)
    rec = recommend(m, effective_batch=effective_batch, gpu_mem_bytes=mem, **common)
    inputs = dict(batch_size=batch_size, seq_len=seq_len, precision=precision, optimizer=optimizer,
                  optimizer_impl=optimizer_impl, zero_stage=zero_stage, tp=tp, pp=pp, gpus=gpus,
                  dp=gpus // (tp * pp), gpu_mem_gib=gpu_mem_gib, checkpointing=checkpointing,
                  effective_batch=effective_batch, accumulation_steps=accumulation)
    serving = _serving_fields(m, inputs, mem)
    out = {"model": name, "num_params": psi, "inputs": inputs, **_plan_fields(plan, mem), **serving,
           "recommendation": dataclasses.asdict(rec)}
    # The cache serving this batch and sequence would hold; not part of the training total.
    out["per_gpu"]["kv_cache_bytes"] = serving["inference"]["kv_cache_bytes"] if m else 0
    if finetune is not None:
        out["per_gpu"]["linear_weight_bytes"] = plan.linear_weight_bytes
        out.update(trainable_params=plan.trainable_params, finetune=ft, finetune_frontier=finetune_frontier(
            m, gpu_mem_bytes=mem, seq_len=seq_len, lora_rank=lora_rank, lora_targets=ft["lora_targets"],
            compute_dtype=ft["compute_dtype"], device="cuda"))
    return out


def _finetune_settings(m: ModelConfig | None, method: str, precision: str, rank: int, alpha: float,
                       targets, *, tp: int, pp: int, gpus: int, zero_stage: int,
                       accumulation: int) -> dict:
    """The fine-tuning inputs, checked: one GPU, a model shape, a known method and targets."""
    check_choice("finetune method", method, FINETUNE_METHODS)
    check_choice("precision", precision, PRECISIONS)
    if m is None:
        raise ConfigError("--finetune needs a model shape (--model or --hf-model), not --params")
    if (tp, pp, gpus, zero_stage, accumulation) != (1, 1, 1, 0, 1):
        raise ConfigError("--finetune plans one GPU: tp, pp and gpus 1, zero-stage 0, no accumulation")
    _positive(lora_rank=rank)
    if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"lora_alpha={alpha!r} must be a positive number")
    parsed = parse_lora_targets(targets)
    if method != "full":
        lora_module_names(m, parsed)
    dtype = "fp32" if precision == "fp32" else "fp16" if precision.startswith("fp16") else "bf16"
    return {"method": method, "lora_rank": rank, "lora_alpha": alpha, "lora_targets": list(parsed),
            "lora_modules": lora_module_names(m, parsed) if method != "full" else [],
            "compute_dtype": dtype, "adapter_dtype": dtype, "nf4_block_size": NF4_BLOCK_SIZE}


def _model_or_params(model: str | ModelConfig | None, params) -> tuple[ModelConfig | None, int, str | None]:
    if model is not None and params is not None:
        raise ConfigError("give --model or --params, not both")
    if isinstance(model, ModelConfig):  # a shape of one's own: named by the folder it came from
        return model, _count_params(model), model.source or "custom shape"
    if params is None:
        name = model or "tiny"
        if name not in MODELS:
            raise ConfigError(f"unknown model {name!r}; valid: {', '.join(PRESETS)}")
        return MODELS[name], _count_params(MODELS[name]), name
    try:
        value = float(params)
    except (TypeError, ValueError):
        raise ConfigError(f"params={params!r} is not a number (e.g. 7.5e9)") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise ConfigError(f"params={params!r} must be a positive whole number of parameters")
    return None, int(value), None


def _gpu_mem_bytes(gib: float) -> int:
    if not isinstance(gib, (int, float)) or not math.isfinite(gib) or gib <= 0:
        raise ConfigError(f"gpu_mem_gib={gib!r} must be a positive number of GiB")
    return int(gib * GIB)


def _accumulation(batch_size: int, effective_batch: int | None, dp: int) -> tuple[int, int]:
    """(effective batch, accumulation steps) for micro-batches of `batch_size` on `dp` ranks."""
    if effective_batch is None:
        return batch_size * dp, 1
    _positive(effective_batch=effective_batch)
    if effective_batch % (batch_size * dp):
        raise ConfigError(f"effective batch {effective_batch} is not a multiple of batch size "
                          f"{batch_size} x {dp} data-parallel ranks")
    return effective_batch, effective_batch // (batch_size * dp)


def _plan_fields(plan: MemoryPlan, mem: int) -> dict:
    terms = ("param", "grad", "optimizer", "activation", "overhead")
    per_gpu = {f"{t}_bytes": getattr(plan, f"{t}_bytes") for t in terms}
    per_gpu.update({f"{t}_bytes": getattr(plan, f"{t}_bytes") for t in ("weight_copy", "gathered")
                    if getattr(plan, f"{t}_bytes")})  # autocast's casts, FSDP2's gathered weights
    per_gpu.update(model_states_bytes=plan.model_states_bytes, total_bytes=plan.total_bytes,
                   activation_bytes_per_layer=plan.activation_bytes_per_layer)
    return {"per_gpu": per_gpu, "held_at_peak": list(plan.held_at_peak),
            "peak_phase": plan.peak_phase, "phase_bytes": plan.phase_bytes, "stage": plan.stage,
            "formulas": plan.formulas, "gpu_mem_bytes": mem, "fits": plan.total_bytes <= mem,
            "headroom_bytes": mem - plan.total_bytes}


def _serving_fields(m: ModelConfig | None, inputs: dict, mem: int) -> dict:
    """The KV cache (per GPU, at the same batch and sequence) and a serving plan: weights + cache.
    It is not part of the training step's total."""
    if m is None:
        return {"kv_cache_bytes_per_token": None, "inference": None}
    b, s, p = inputs["batch_size"], inputs["seq_len"], inputs["precision"]
    serve = inference_memory(m, batch_size=b, seq_len=s, precision=p, tp=inputs["tp"], pp=inputs["pp"])
    return {"kv_cache_bytes_per_token": kv_bytes_per_token(m, DTYPE_OF[p]),
            "inference": {"param_bytes": serve.param_bytes, "kv_cache_bytes": serve.kv_cache_bytes,
                          "total_bytes": serve.total_bytes, "fits": serve.total_bytes <= mem}}
