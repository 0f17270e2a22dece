"""Training memory: what one training step holds per GPU, and its peak (`training_memory`).

Three sources, each term derived from shapes, never fitted to a measurement:
- model states per ZeRO stage (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models", section 3.1 and figure 1; `labkit.planner.sharding`);
- activations per layer, the analysis of Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (section 4), redone for the blocks of
  `labkit.blocks.model` (`labkit.planner.activations`);
- the step's timeline: which of these coexist at the peak (here: the temporaries of the forward,
  the backward and the optimizer step).
"""
from __future__ import annotations

import dataclasses

from labkit.config import ModelConfig
from labkit.planner.activations import (_checkpointed_on_stage, _head_bytes, _layer_bytes,
                                        _stage_activations)
from labkit.planner.formulas import _formulas
from labkit.planner.model import LocalShape, StageParams, layer_params, stage_params
from labkit.planner.plan import MemoryPlan, _resolve, _Run
from labkit.planner.precision import LOW_BIT, low_bit_state_bytes, low_bit_update_bytes
from labkit.planner.sharding import (_fsdp2_forward_gathers, _fsdp2_root_reduce, _zero_buffers,
                                     root_unit_params, zero_model_state_bytes)


def training_memory(m: ModelConfig | None = None, *, num_params: int | None = None,
                    batch_size: int = 1, seq_len: int = 2048, precision: str = "fp32",
                    optimizer: str = "adamw", zero_stage: int = 0, tp: int = 1, pp: int = 1,
                    gpus: int = 1, checkpointing: str = "none",
                    checkpointed_layers: int | None = None, accumulation_steps: int = 1,
                    device: str | None = None, optimizer_impl: str | None = None,
                    fsdp2: bool = False, loss_chunk: int = 0, packed: bool = False,
                    sequence_parallel: bool = False) -> MemoryPlan:
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

    `precision` bf16 / fp16: autocast over fp32 weights, fp32 gradients and fp32 AdamW (not
    bf16_pure, pure 16-bit training): the matmuls' activations in 16 bits, the
    residual stream and the norms in fp32, and autocast's cached 16-bit weight copies
    (`weight_copy_bytes`): all of them at the end of the forward, a third phase ("forward"),
    and those the backward keeps at its start. `fsdp2`: ZeRO stages 2 and 3 as FSDP2 builds them
    (labkit's runs: `gathered_bytes`, the whole parameters beside the shards between the passes,
    and its working buffers), not the paper's; nothing changes below stage 2 or on one replica.
    `packed`: each row holds several documents, masked apart (`labkit.blocks.packing`): the
    position tables per row and the document mask (`_document_mask_bytes`).
    `loss_chunk`: the head and the loss fused, that many tokens of logits at a time
    (`labkit.blocks.losses.chunked_lm_loss`; 0: the plain loss on whole logits).
    `sequence_parallel` (with tp > 1): Megatron's, as `transforms.apply_tp` builds it: each
    block's norms keep what they save for backward for this rank's seq_len / tp tokens alone."""
    r = _resolve(m, num_params=num_params, batch_size=batch_size, seq_len=seq_len,
                 precision=precision, optimizer=optimizer, zero_stage=zero_stage, tp=tp, pp=pp,
                 gpus=gpus, checkpointing=checkpointing, checkpointed_layers=checkpointed_layers,
                 accumulation_steps=accumulation_steps, device=device, optimizer_impl=optimizer_impl,
                 fsdp2=fsdp2, loss_chunk=loss_chunk, packed=packed, sequence_parallel=sequence_parallel)
    if r.m is None:
        psi = -(-r.num_params // (tp * pp))
        return _stage_plan(r, StageParams(psi, psi, 2 * psi, psi, 0), "all", first=False, last=False)
    stages = [("all", True, True)] if pp == 1 else [("first", True, False), ("last", False, True)]
    plans = [_stage_plan(r, stage_params(r.m, tp=tp, pp=pp, first=first, last=last), name,
                         first=first, last=last) for name, first, last in stages]
    return max(plans, key=lambda plan: plan.total_bytes)


def _stage_plan(r: _Run, sp: StageParams, stage: str, *, first: bool, last: bool) -> MemoryPlan:
    low_bit = r.optimizer in LOW_BIT
    param, grad, opt = zero_model_state_bytes(sp.total, stage=r.zero_stage, dp=r.dp, precision=r.precision,
                                              optimizer="adamw" if low_bit else r.optimizer)
    if low_bit:
        opt = low_bit_state_bytes(list(sp.sizes), r.optimizer)
    # FSDP2's ZeRO-2 (reshard_after_forward=False): at rest only the shards; from each unit's
    # forward to its backward the whole parameters beside them (the paper's stage 2 keeps them
    # whole always: `param`, then, is what the step holds between the passes, less the shards).
    gathered = 0
    if r.fsdp2_sharded and r.zero_stage == 2:
        gathered, param = r.prec.gathered * sp.total, r.prec.weight * -(-sp.total // r.dp)
    act, per_layer = _stage_activations(r, sp, first, last) if r.m is not None else (0, 0)
    # Gradients allocated through the whole backward: earlier micro-batches' (accumulation,
    # pipelining), or DDP's all-reduce buckets (stages 0 and 1), which live as long as the model.
    resident = r.accumulation_steps > 1 or r.pp > 1 or (r.dp > 1 and r.zero_stage < 2)
    held_grad = grad if resident else 0
    # FSDP2 accumulates into the gradient shards: each micro-batch's backward makes every unit's
    # whole gradients anew, as without accumulation, and reduce-scatters them into the shards.
    fresh = not resident or (r.fsdp2_sharded and r.pp == 1)
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
    # FSDP2's last reduce-scatter, the root unit's, after the backward
    reduce = _fsdp2_root_reduce(r, grad) if r.m is not None and last else 0
    if reduce:
        phases["reduce"] = param + opt + reduce
    # Tensor parallelism as labkit builds it (the embedding RowwiseParallel over the vocabulary):
    # the embedding's backward, the last the backward reaches, makes the whole-vocabulary
    # gradient (V x d) on every rank beside every other gradient, then keeps the rank's rows.
    # Under FSDP2 the root unit is still gathered then, and its tp-local gradients (the head's
    # and the embedding's rows) wait for its reduce-scatter beside their shards.
    embedding = r.prec.whole_grad * r.m.vocab_size * r.shape.d if r.tp > 1 and first \
        and r.m is not None else 0
    if embedding and r.fsdp2_sharded:
        embedding += r.prec.gathered * root_unit_params(r.m, r.shape.vocab, r.shape.d) \
            + 2 * r.prec.whole_grad * r.shape.vocab * r.shape.d
    if embedding:
        phases["embedding"] = param + opt + grad + embedding
    peak = max(phases, key=phases.get)
    starts = peak == "forward" and at_start > at_end
    with_grad = ("grad",) if resident else ()
    held = {"backward": ("param", "gathered", "optimizer", "activation", "weight_copy", "overhead") + with_grad,
            "forward": ("param", "gathered", "optimizer") + (() if starts else ("activation", "weight_copy"))
            + ("overhead",) + with_grad,
            "step": ("param", "grad", "optimizer", "overhead"),
            "reduce": ("param", "grad", "optimizer", "overhead"),
            "embedding": ("param", "grad", "optimizer", "overhead")}[peak]
    overhead = {"backward": backward, "step": step, "reduce": reduce - grad,
                "embedding": embedding,
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
    checkpointed block casts again when it recomputes, and so does the chunked loss for the
    head). 0 without autocast."""
    if not r.prec.cast:
        return 0, 0
    block = _matmul_weights(r.shape, r.m.arch)
    head = r.shape.vocab * r.shape.d if last else 0
    k = _checkpointed_on_stage(r, sp.num_layers)
    return (r.prec.cast * (sp.num_layers * block + head),
            r.prec.cast * ((sp.num_layers - k) * block + (0 if r.loss_chunk else head)))


def _forward_temporaries(r: _Run, last: bool) -> int:
    """At the end of an autocast forward, while log_softmax writes its output (an activation):
    the 16-bit logits and their fp32 copy (b·s·V each), which the loss alone holds. Chunked: one
    chunk's logits and fp32 copy (c·V each), or in fp32 its logits beside two c-long results
    (its log-sum-exp and its targets' logits)."""
    if not last:
        return 0
    if r.loss_chunk:
        c = _chunk(r)
        return 4 * c * r.shape.logits + max(_logits_bytes(r) * c * r.shape.logits, 8 * c)
    return (r.prec.cast + 4) * r.batch_size * r.seq_len * r.shape.logits


def _logits_bytes(r: _Run) -> int:
    """Bytes of a chunk's 16-bit logits before their fp32 copy (autocast's, or 16-bit weights
    and activations: FSDP2's bf16 policy, pure 16-bit); 0 where they are fp32 already."""
    return r.prec.act if r.prec.act < 4 else 0


def _chunk(r: _Run) -> int:
    """The chunked loss's tokens of logits at once: its chunk, or the whole micro-batch."""
    return min(r.loss_chunk, r.batch_size * r.seq_len)


def _chunked_loss_backward(r: _Run, head_grad: int) -> int:
    """The chunked loss's backward, beyond the activations (`chunked_lm_loss`): the head's
    weight gradient accumulated in fp32 (its whole gradient when the weight is fp32, else beside
    it), the hidden states' gradient (b·s·d), autocast's 16-bit copy of the head's weight made
    again, and one chunk's logits remade, its fp32 softmax gradient and its share of the hidden
    states' gradient: c·((cast + 4)·V + (cast or 4)·d), measured."""
    s, p, tokens, c = r.shape, r.prec, r.batch_size * r.seq_len, _chunk(r)
    accumulator = 4 * s.vocab * s.d + (head_grad if p.whole_grad != 4 else 0)
    low = _logits_bytes(r)
    return (accumulator + p.residual * tokens * s.d + p.cast * s.vocab * s.d
            + c * ((low + 4) * s.logits + (low or 4) * s.d))


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
        head_grad = 0 if resident else p.whole_grad * s.vocab * s.d
        loss = 8 * tokens * s.logits
        head = head_grad + p.act * tokens * s.d + (p.act - 4) * tokens * s.logits
        if r.loss_chunk:  # the loss and the head's backward are one, chunk by chunk
            loss, head = _chunked_loss_backward(r, head_grad), 0
        after_head += head_grad - _head_bytes(r)
    first, per_block = _block_backward(r, sp, resident)
    # the j-th block the backward goes through: j blocks finished before it
    blocks = max(after_head + first + j * per_block + _zero_buffers(r, sp, last, resident, j)
                 for j in range(sp.num_layers))
    return max(max(0, loss, head) + _zero_buffers(r, sp, last, resident, None), blocks)


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
    plain = _layer_bytes(r, "none")
    kept = _layer_bytes(r, r.checkpointing) if k else plain
    recompute = plain - tokens * _recompute_overlap(r) if k else 0
    recompute += p.cast * _matmul_weights(s, r.m.arch) if k else 0  # autocast's casts again
    w2_grad = 0 if resident else p.whole_grad * s.d * s.f
    live = (2 if r.m.arch == "llama" else 1) * p.act * tokens * s.f
    grads = 0 if resident else p.whole_grad * layer_params(r.m, s)[0]
    if r.fsdp2_sharded:  # only the shard, in the reduced dtype
        grads = 0 if r.accumulation_steps > 1 else p.grad * -(-layer_params(r.m, s)[0] // r.dp)
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
    if r.optimizer in LOW_BIT:
        return low_bit_update_bytes(list(sp.sizes), r.optimizer, r.impl)
    shard = (lambda n: -(-n // r.dp)) if r.zero_stage >= 1 else (lambda n: n)
    upcast = 4 * shard(sp.total) if r.prec.master else 0
    if r.optimizer == "sgd":
        return upcast
    adam = {"single": r.prec.moment * shard(sp.largest_pair),
            "foreach": r.prec.moment * shard(sp.total), "fused": 0}[r.impl]
    return upcast + adam
