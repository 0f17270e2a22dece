"""Activations: what the blocks of `labkit.blocks.model` keep for backward, per token, per layer
(`layer_activation_bytes`) and per pipeline stage, beside the paper's own formulas
(`korthikanti_activation_bytes`: Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", section 4)."""
from __future__ import annotations

from labkit.config import ConfigError, ModelConfig
from labkit.planner.model import StageParams
from labkit.planner.plan import _resolve, _Run


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


def layer_activation_bytes(m: ModelConfig, *, batch_size: int, seq_len: int, precision: str = "fp32",
                           tp: int = 1, checkpointing: str = "none", device: str | None = None,
                           sequence_parallel: bool = False) -> int:
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
    paper's sbh(10 + 24/t + ...). With `sequence_parallel` each norm keeps what it saves for its
    rank's tokens alone; its output, all-gathered for the next matmul, is kept whole by that
    matmul (the paper's 34sbh/t also shards the matmuls' inputs, which Megatron gathers again in
    the backward)."""
    run = _resolve(m, batch_size=batch_size, seq_len=seq_len, precision=precision, tp=tp,
                   gpus=tp, checkpointing=checkpointing, device=device, sequence_parallel=sequence_parallel)
    return _layer_bytes(run, run.checkpointing)


def _norm_bytes(r: _Run, consumers: int = 1) -> int:
    """Per token, one norm: what it keeps for backward plus its output (the next matmul's input).
    Under autocast the output stays fp32 and is not kept: each of its `consumers` (the matmuls
    it feeds) saves its own 16-bit cast of it (autocast caches only the weights' casts)."""
    s = r.shape
    out = consumers * r.prec.cast * s.d if r.prec.cast else r.prec.act * s.d
    return _norm_kept_bytes(r) + out


def _norm_kept_bytes(r: _Run) -> int:
    """Per token, what one norm saves for its own backward. Llama's RMSNorm: x32 (4d, the input
    itself in fp32), rsqrt (4), x·rsqrt (n·d); GPT-2's LayerNorm: its input (n·d), mean and rstd."""
    d, n = r.shape.d, r.prec.residual
    return 4 * d + 4 + n * d if r.m.arch == "llama" else n * d + 2 * r.stat


def _attention_bytes(r: _Run) -> int:
    """Per token: SDPA's inputs q, k, v (after RoPE), its output (wo's input) and logsumexp (fp32)."""
    s, a = r.shape, r.prec.act
    return a * (s.q + 2 * s.kv) + a * s.q + 4 * s.heads


def _mlp_bytes(r: _Run) -> int:
    """Per token: SwiGLU keeps w1 x, silu(w1 x), w3 x and their product (w2's input); GELU keeps
    its input and output."""
    return (4 if r.m.arch == "llama" else 2) * r.prec.act * r.shape.f


def _selective_bytes(r: _Run) -> int:
    """Per token, a selectively recomputed block: its input, every matmul's output (wq, wk, wv,
    wo, w1, [w3], w2; wo's and w2's are d wide on every rank) and SDPA's output and logsumexp."""
    s, a = r.shape, r.prec.act
    mlp = (2 if r.m.arch == "llama" else 1) * s.f + s.d
    return r.prec.residual * s.d + a * (s.q + 2 * s.kv + s.d + mlp + s.q) + 4 * s.heads


def _layer_bytes(r: _Run, mode: str) -> int:
    """One layer's bytes kept for backward over the micro-batch. Sequence parallelism (no
    recomputation) leaves each of the two norms its own saved tensors for this rank's tokens alone."""
    tokens = r.batch_size * r.seq_len
    out = tokens * _layer_bytes_per_token(r, mode)
    if r.sequence_parallel and mode == "none":
        out -= 2 * _norm_kept_bytes(r) * (tokens - tokens // r.tp)
    return out


def _layer_bytes_per_token(r: _Run, mode: str) -> int:
    if mode == "full":
        return r.prec.residual * r.shape.d  # the block's input, held by torch.utils.checkpoint
    if mode == "selective":
        return _selective_bytes(r)
    # the attention norm feeds wq, wk and wv; the MLP norm w1 and w3 (SwiGLU) or w1 (GELU)
    mlp_inputs = 2 if r.m.arch == "llama" else 1
    return _norm_bytes(r, 3) + _norm_bytes(r, mlp_inputs) + _attention_bytes(r) + _mlp_bytes(r)


def _embedding_side_bytes(r: _Run) -> int:
    """Per micro-batch on the first stage: RoPE's cos and sin tables (s x head_dim each, fp32,
    built once per forward and held by every layer's backward), or GPT-2's int64 positions
    (saved by the position embedding); one per row when packed rows restart them per document."""
    rows = r.batch_size if r.packed else 1
    if r.m.arch == "llama":
        return rows * 2 * r.seq_len * r.m.head_dim * 4
    return rows * 8 * r.seq_len


def _document_mask_bytes(r: _Run, kept: int, recomputed: int) -> int:
    """A packed micro-batch's document mask (b x s x s): SDPA's copy of it in the activation
    dtype, saved by each of the `kept` layers whose attention keeps its inputs, and the boolean
    mask itself, an input every `recomputed` (checkpointed) layer keeps for its recomputation
    (otherwise freed after the forward). Measured on the CPU's SDPA."""
    if not r.packed:
        return 0
    square = r.batch_size * r.seq_len * r.seq_len
    return square * r.prec.act * kept + (square if recomputed else 0)


def _head_bytes(r: _Run) -> int:
    """Per micro-batch on the last stage: the final norm (as a block's), cross-entropy's fp32
    log-probabilities (b·s·V, kept by log_softmax for its backward; the logits themselves are
    freed), the int64 targets nll_loss keeps, and its fp32 total_weight scalar. Chunked
    (`loss_chunk`): no logits at all, one fp32 log-sum-exp per token beside the targets, and the
    final norm's output kept in the residual stream's dtype rather than as the head's 16-bit
    input under autocast. The targets are the loss's flattened copy of the next tokens (a
    shifted view of the batch); a packed batch's own targets are contiguous: no copy."""
    tokens, targets = r.batch_size * r.seq_len, _target_copy_bytes(r)
    if r.loss_chunk:
        return tokens * (_norm_bytes(r) + 4 + targets + (r.prec.residual - r.prec.act) * r.shape.d)
    return tokens * (_norm_bytes(r) + 4 * r.shape.logits + targets) + 4


def _target_copy_bytes(r: _Run) -> int:
    """Per token: the int64 targets the loss keeps as its own copy (none for a packed batch)."""
    return 0 if r.packed else 8


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
    k = _checkpointed_on_stage(r, sp.num_layers)
    recomputed = _layer_bytes(r, r.checkpointing)
    plain = _layer_bytes(r, "none")
    layers = k * recomputed + (sp.num_layers - k) * plain
    masks = _document_mask_bytes(r, sp.num_layers - k, k)
    in_flight = r.pp if first else 1
    total = in_flight * (layers + masks + (_embedding_side_bytes(r) if first else 0))
    return total + (_head_bytes(r) if last else 0), recomputed
