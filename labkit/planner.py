"""The analytic model: the napkin math that experiments show beside their measurements.

Counts follow the model in `labkit.model` exactly (the tests hold them to the module's own
parameter count and to FlopCounterMode), so a gap between predicted and measured is a finding.
"""
from __future__ import annotations

from labkit.config import DTYPE_BYTES, ModelConfig


def block_linear_params(m: ModelConfig, *, biases: bool = True) -> int:
    """Weights (and biases) of the linear layers of one block; the weights alone are what the
    matmuls multiply by (bias adds are not counted as FLOPs)."""
    hd, bias = m.head_dim, biases and m.arch == "gpt2"
    q_o = 2 * m.hidden_size * m.num_heads * hd
    k_v = 2 * m.hidden_size * m.num_kv_heads * hd
    mlp = (3 if m.arch == "llama" else 2) * m.hidden_size * m.ffn_size
    biases = (m.num_heads * hd * 2 + m.num_kv_heads * hd * 2 + m.ffn_size + m.hidden_size) if bias else 0
    return q_o + k_v + mlp + biases


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
    held in 16 bits); the per-tensor step counters are a few bytes and left out."""
    return num_params(m) * 4 * (3 if master_copy else 2)


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
