"""One plain decoder: Llama-style (RMSNorm, RoPE, grouped-query attention, SwiGLU) or, by config,
GPT-2-style (learned positions, LayerNorm with biases, GELU MLP, tied embeddings). With
`num_experts` > 0 each Llama-style block's MLP is a mixture of experts (`labkit.blocks.moe`).

No technique code lives here. Techniques act from outside: through the attention switch
(`model.attention`), the KV-cache slot (`forward(..., cache=...)`), or by transforming the module.
A cache is any object with `update(layer_idx, k, v) -> (k_all, v_all)` taking (B, kv_heads, T, hd).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from labkit.blocks import losses
from labkit.blocks.moe import MoE
from labkit.config import ModelConfig

StartPos = int | torch.Tensor  # a batch's first position, or one per row (B,)

ATTENTION_IMPLS = ("sdpa", "naive")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, as Llama's reference does: a bf16 mean of squares loses precision.
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                llama3: tuple[float, float, float, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, (T, head_dim) for positions (T,), (B, 1, T, head_dim) for per-row positions
    (B, T); fp32, rotate-half layout. `llama3`: that release's frequency scaling
    (ModelConfig.rope_llama3)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    if llama3 is not None:
        inv_freq = llama3_inv_freq(inv_freq, *llama3)
    angles = positions.float()[..., None] * inv_freq  # (..., T, hd/2)
    angles = torch.cat([angles, angles], dim=-1)  # (..., T, hd)
    if positions.dim() == 2:
        angles = angles[:, None]  # broadcast over heads
    return angles.cos(), angles.sin()


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_len: int) -> torch.Tensor:
    """Llama 3.1's RoPE scaling, as transformers' `_compute_llama3_parameters` computes it (the
    same operations in the same order, so the tables match bit for bit): wavelengths longer
    than original_len / low_freq_factor are stretched by `factor`, those shorter than
    original_len / high_freq_factor kept, those between interpolated."""
    low_wavelen, high_wavelen = original_len / low_freq_factor, original_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (B, heads, T, hd) by the position tables; computed in fp32, returned in x's dtype."""
    x32 = x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).type_as(x)


def causal_mask(num_queries: int, num_keys: int, start_pos: StartPos,
                device: torch.device) -> torch.Tensor | None:
    """True where query i (at start_pos + i) may see key j: (T, S) bool, None when nothing is
    masked; (B, 1, T, S) for per-row start positions (B,), which also hides the keys past a
    shorter row's end (padding)."""
    if isinstance(start_pos, int):
        if num_queries == 1:
            return None
        q_pos = torch.arange(start_pos, start_pos + num_queries, device=device)[:, None]
        return torch.arange(num_keys, device=device)[None, :] <= q_pos
    q_pos = start_pos[:, None] + torch.arange(num_queries, device=device)  # (B, T)
    return (torch.arange(num_keys, device=device) <= q_pos[..., None])[:, None]


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document, (B, T) from document ids (B, T): 0 where a
    row's id changes, counting up until the next change (a document's tokens are contiguous)."""
    T = document_ids.shape[1]
    steps = torch.arange(T, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return steps - torch.where(starts, steps, 0).cummax(dim=1).values


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Block-diagonal causal mask, (B, 1, T, T) bool: query i sees key j when j <= i and both
    belong to the same document (documents contiguous in their row)."""
    T = document_ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return (document_ids[:, :, None] == document_ids[:, None, :])[:, None] & causal


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: StartPos,
           impl: str, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q (B, H, T, hd) over k, v (B, KV, S, hd); returns (B, H, T, hd).
    With fewer kv heads (grouped-query attention) each serves H / KV query heads. `mask`, when
    given, replaces the causal one (a packed batch's `document_mask`)."""
    T, S = q.shape[-2], k.shape[-2]
    gqa = q.shape[1] != k.shape[1]
    if impl == "sdpa":  # enable_gqa shares kv heads without copying them
        # plain causal: no mask tensor needed
        whole = mask is None and T == S and isinstance(start_pos, int)
        if mask is None and not whole:
            mask = causal_mask(T, S, start_pos, q.device)
        if gqa and q.is_cuda and (mask is not None or q.dtype == torch.float32):
            # CUDA's one fused kernel that shares kv heads (flash) takes neither fp32 nor a mask;
            # the others need full heads, else SDPA falls back to math and holds the S x S scores
            k, v, gqa = *repeat_kv(k, v, q.shape[1]), False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=whole and T > 1,
                                              enable_gqa=gqa)
    if gqa:
        k, v = repeat_kv(k, v, q.shape[1])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    mask = causal_mask(T, S, start_pos, q.device) if mask is None else mask
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ v


def repeat_kv(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v (B, KV, S, hd) with each kv head repeated for its H / KV query heads."""
    repeats = heads // k.shape[1]
    return k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        bias = cfg.arch == "gpt2"
        qkv_bias = bias or cfg.qkv_bias  # Qwen2: biases on q, k and v, none on o
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.hidden_size, cfg.num_heads * hd, bias=qkv_bias)
        self.wk = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=qkv_bias)
        self.wv = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, start_pos: StartPos, cache, impl: str, rope,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.cfg.head_dim
        # view(..., -1, hd): the local head count, so a tensor-parallel shard works unchanged.
        q = self.wq(x).view(B, T, -1, hd).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, -1, hd).transpose(1, 2)  # (B, KV, T, hd)
        v = self.wv(x).view(B, T, -1, hd).transpose(1, 2)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)  # (B, KV, S, hd)
        y = attend(q, k, v, start_pos, impl, mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.arch = cfg.arch
        if cfg.arch == "llama":  # SwiGLU: w2(silu(w1 x) * w3 x)
            self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
            self.w3 = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=False)
        else:
            self.w1 = nn.Linear(cfg.hidden_size, cfg.ffn_size, bias=True)
        self.w2 = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=cfg.arch == "gpt2")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.arch == "llama":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.arch == "llama":
        return RMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = make_norm(cfg), make_norm(cfg)
        self.attn = Attention(cfg, layer_idx)
        self.mlp = MoE(cfg) if cfg.num_experts else MLP(cfg)  # MoE: labkit.blocks.moe

    def forward(self, x: torch.Tensor, start_pos: StartPos, cache, impl: str, rope,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        # mask by keyword: tensor parallel's PrepareModuleInput lays out the positional inputs
        x = x + self.attn(self.attn_norm(x), start_pos, cache, impl, rope, mask=mask)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab), or (B, 1, vocab) with `last_only`; with `targets`,
    the mean loss instead, its head and loss fused `loss_chunk` tokens at a time when that is
    set (`labkit.blocks.losses`: the logits are never whole)."""

    loss_chunk = 0  # 0: the plain loss on whole logits

    def __init__(self, cfg: ModelConfig, attention: str = "sdpa"):
        super().__init__()
        self.cfg, self.attention = cfg, attention
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.hidden_size) if cfg.arch == "gpt2" else None
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, *, start_pos: StartPos = 0, cache=None,
                last_only: bool | torch.Tensor = False, targets: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`start_pos`: the position of tokens[:, 0], one for the batch or one per row (a (B,)
        tensor: rows of different lengths in one batch, as continuous batching runs them).
        `last_only`: logits at the last position only, or at one index per row ((B,): each
        right-padded row's last real token). `document_ids` (B, T): a packed batch's document
        of each token (`labkit.blocks.packing`); each token then attends only within its
        document (`document_mask`), at its position inside it (`document_positions`)."""
        x = self.embed(tokens)  # (B, T, d)
        mask = None
        if document_ids is not None:
            if cache is not None or not isinstance(start_pos, int) or start_pos != 0:
                raise ValueError("document_ids: a whole packed batch from position 0, no cache")
            positions, mask = document_positions(document_ids), document_mask(document_ids)
        else:
            steps = torch.arange(tokens.shape[1], device=tokens.device)
            per_row = isinstance(start_pos, torch.Tensor)
            positions = start_pos[:, None] + steps if per_row else start_pos + steps  # (B, T) or (T,)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed(positions)
        else:  # RoPE tables once per forward, shared by every layer
            rope = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_llama3)
        for layer in self.layers:
            x = layer(x, start_pos, cache, self.attention, rope, mask=mask)
        if isinstance(last_only, torch.Tensor):
            x = x[torch.arange(x.shape[0], device=x.device), last_only][:, None]
        elif last_only:
            x = x[:, -1:]
        if targets is None:
            return self.lm_head(self.norm(x))
        if self.loss_chunk:
            return losses.chunked_lm_loss(self.norm(x), self.lm_head.weight, targets, self.loss_chunk)
        return losses.lm_loss(self.lm_head(self.norm(x)), targets)


def init_weights(model: Decoder) -> None:
    """GPT-2's scheme: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)."""
    for name, p in model.named_parameters():
        init_parameter(name, p, model.cfg.num_layers)


def init_parameter(name: str, p: torch.Tensor, num_layers: int) -> None:
    std = 0.02
    if p.dim() == 1:
        nn.init.zeros_(p) if name.endswith("bias") else nn.init.ones_(p)
    elif name.endswith(("wo.weight", "w2.weight", "experts.w2")):
        nn.init.normal_(p, 0.0, std / math.sqrt(2 * num_layers))
    else:
        nn.init.normal_(p, 0.0, std)


def materialize(model: Decoder, device: str | torch.device, *, seed: int = 0) -> Decoder:
    """A decoder built on the meta device (and sharded since: DTensor parameters) made real on
    `device` with `build_model`'s weights: the same seeded draws in the same order, each
    parameter's whole tensor drawn in turn in fp32 and only this rank's shard of it kept. One
    whole tensor at a time, never the whole model."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            whole = torch.empty(p.shape, device=device)
            init_parameter(name, whole, model.cfg.num_layers)
            if isinstance(p, DTensor):  # every rank drew the same whole: keep this one's shard
                whole = distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
            p.copy_(whole.to(p.dtype))
    return model


def build_model(cfg: ModelConfig, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0, attention: str = "sdpa") -> Decoder:
    """A seeded decoder on `device` in `dtype`; on `meta` nothing is allocated (for counting).
    A shape read from a Hugging Face folder (`cfg.source`) that holds safetensors weights gets
    those weights instead, as long as the shape is the folder's own (not shrunk with --set)."""
    if attention not in ATTENTION_IMPLS:
        raise ValueError(f"unknown attention {attention!r}; valid: {', '.join(ATTENTION_IMPLS)}")
    device = torch.device(device)
    # Built on meta and then given memory: nn.Linear's and nn.Embedding's own initialisation,
    # which init_weights overwrites, is never drawn (45% of the tiny preset's build time: 49 -> 27 ms).
    with torch.device("meta"):
        model = Decoder(cfg, attention)
    if device.type != "meta":
        model.to_empty(device=device)
        if cfg.tie_embeddings:  # to_empty gives each module a parameter of its own
            model.lm_head.weight = model.embed.weight
        torch.manual_seed(seed)
        with torch.no_grad():
            init_weights(model)
        if cfg.source:  # here, not in each experiment: every experiment builds its model here
            from labkit.blocks import hf  # only when a shape came from a folder

            hf.maybe_load_weights(model)
    return model.to(dtype)


def num_params(model: nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Parameters counted once each (tied weights once); optionally without the embeddings."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        total -= sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    return total
