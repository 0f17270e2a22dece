"""The model's sizes: parameter counts, FLOPs of training and of generation, and the parameters
one GPU holds under tensor and pipeline parallelism (`local_shape`, `stage_params`).

Counts follow the model in `labkit.blocks.model` exactly (the tests hold them to the module's own
parameter count and to FlopCounterMode), so a gap between predicted and measured is a finding.
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit.config import DTYPE_BYTES, ConfigError, ModelConfig
from labkit.planner.precision import optimizer_bytes_per_param


def mlp_params(m: ModelConfig, *, active: bool = False) -> int:
    """Weights of one block's MLP: the dense MLP, or an MoE's router, num_experts SwiGLU experts
    and its gated shared expert (`active`: the router, the k experts one token uses and the
    shared expert)."""
    d = m.hidden_size
    if not m.num_experts:
        return (3 if m.arch == "llama" else 2) * d * m.ffn_size
    experts = m.experts_per_token if active else m.num_experts
    shared = 3 * d * m.shared_expert_ffn_size + d if m.shared_expert_ffn_size else 0  # + its gate
    return m.num_experts * d + experts * 3 * d * m.expert_ffn_size + shared


def block_linear_params(m: ModelConfig, *, biases: bool = True, active: bool = False) -> int:
    """Weights (and biases) of the linear layers of one block; the weights alone are what the
    matmuls multiply by (bias adds are not counted as FLOPs). `active`: an MoE block's weights
    one token uses (`mlp_params`)."""
    hd, gpt2 = m.head_dim, m.arch == "gpt2"
    q_o = 2 * m.hidden_size * m.num_heads * hd
    k_v = 2 * m.hidden_size * m.num_kv_heads * hd
    mlp = mlp_params(m, active=active)
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
    precision = "bf16_weights" if master_copy else "fp32"
    return num_params(m) * optimizer_bytes_per_param(precision, "adamw")


def attention_flops(m: ModelConfig, *, batch: int, new: int, keys: int) -> int:
    """Scores and weighted sum, 2 * 2 * new * keys * head_dim per head and layer. The full
    new x keys matrix counts, as FlopCounterMode counts SDPA (causal masking does not halve it)."""
    return batch * 4 * new * keys * m.num_layers * m.num_heads * m.head_dim


def forward_flops(m: ModelConfig, *, batch: int, new: int, keys: int, logits: int) -> int:
    """FLOPs of one forward pass over `new` tokens attending to `keys` positions, projecting
    `logits` positions to the vocabulary (multiply-add = 2). An MoE block counts the weights one
    token uses (router, k experts, shared expert), as if no assignment were dropped."""
    blocks = 2 * new * m.num_layers * block_linear_params(m, biases=False, active=True)
    head = 2 * logits * m.hidden_size * m.vocab_size
    return batch * (blocks + head) + attention_flops(m, batch=batch, new=new, keys=keys)


def train_step_flops(m: ModelConfig, *, batch: int, seq_len: int, attention: str = "sdpa") -> int:
    """Forward + backward: the matmuls cost 2x forward again (the familiar 6 * N * tokens);
    attention's backward is 2x its forward with plain matmuls, 2.5x with SDPA, whose fused
    backward recomputes the scores (5 matmuls)."""
    attn = attention_flops(m, batch=batch, new=seq_len, keys=seq_len)
    rest = forward_flops(m, batch=batch, new=seq_len, keys=seq_len, logits=seq_len) - attn
    return 3 * rest + attn * (7 if attention == "sdpa" else 6) // 2


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
    vocab: int  # local vocabulary (vocab-parallel embedding and head weights)
    logits: int  # the vocabulary of the logits and the loss on one rank: the whole of it, since
    # labkit's tensor parallelism gathers the head's output (lm_head ColwiseParallel with a
    # Replicate output: the loss is the plain cross-entropy, no loss parallelism)


def local_shape(m: ModelConfig, tp: int = 1) -> LocalShape:
    """Widths on one of `tp` ranks. kv heads split when tp divides them; with fewer kv heads than
    ranks each rank keeps one (Megatron replicates them). An MoE's `f` is the inner width one
    token passes through (k experts and the shared one), what its activations scale with."""
    check_tp(m, tp)
    kv_heads = m.num_kv_heads // tp if m.num_kv_heads % tp == 0 else 1
    f = m.experts_per_token * m.expert_ffn_size + m.shared_expert_ffn_size if m.num_experts else m.ffn_size
    return LocalShape(d=m.hidden_size, q=m.num_heads // tp * m.head_dim, kv=kv_heads * m.head_dim,
                      f=-(-f // tp), heads=m.num_heads // tp, vocab=-(-m.vocab_size // tp),
                      logits=m.vocab_size)


def check_tp(m: ModelConfig, tp: int) -> None:
    if m.num_experts and tp > 1:
        raise ConfigError(f"tp={tp} with num_experts={m.num_experts}: labkit does not split experts "
                          "by tensor parallelism; split them over ranks with expert parallelism (ep)")
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
    sizes: tuple[int, ...] = ()  # each parameter's elements (`stage_tensors`; () without a shape)


def block_tensors(m: ModelConfig, s: LocalShape) -> list[int]:
    """Sizes of one block's parameters on one rank, in the module's order (attn_norm, mlp_norm,
    wq, wk, wv, wo, w1, [w3], w2; each Linear's bias after its weight). Column-parallel weights
    (wq, wk, wv, w1, w3) and their biases split; row-parallel ones (wo, w2) split, their biases
    replicated; norms replicated. Qwen2's q, k, v biases (qkv_bias) split with their weights.
    An MoE block (tp 1): router, stacked w1, w3, w2 of its experts, the shared expert and its gate."""
    if m.arch == "llama":
        attn = ([s.d * s.q, s.q, s.d * s.kv, s.kv, s.d * s.kv, s.kv] if m.qkv_bias
                else [s.d * s.q, s.d * s.kv, s.d * s.kv])
        return [s.d, s.d, *attn, s.q * s.d, *_mlp_tensors(m, s)]
    return [s.d, s.d, s.d, s.d, s.d * s.q, s.q, s.d * s.kv, s.kv, s.d * s.kv, s.kv, s.q * s.d, s.d,
            s.d * s.f, s.f, s.f * s.d, s.d]


def _mlp_tensors(m: ModelConfig, s: LocalShape) -> list[int]:
    """A Llama-style block's MLP tensors, in the module's order (`labkit.blocks.moe.MoE`)."""
    if not m.num_experts:
        return [s.d * s.f, s.d * s.f, s.f * s.d]
    E, f, fs = m.num_experts, m.expert_ffn_size, m.shared_expert_ffn_size
    shared = [s.d * fs, s.d * fs, fs * s.d, s.d] if fs else []
    return [E * s.d, E * f * s.d, E * f * s.d, E * s.d * f, *shared]


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
                                                           embed if first else 0, head if last else 0),
                       sizes=tuple(sizes))
