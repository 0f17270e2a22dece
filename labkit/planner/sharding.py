"""ZeRO and FSDP2: the model states per ZeRO stage (Rajbhandari et al., "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models", section 3.1 and figure 1) and the
working buffers the sharded step holds (gathered weights, unsharded gradients)."""
from __future__ import annotations

from labkit.config import ConfigError, ModelConfig, check_choice
from labkit.planner.model import StageParams, layer_params
from labkit.planner.plan import ZERO_STAGES, _Run
from labkit.planner.precision import PRECISION_BYTES, PRECISIONS, optimizer_bytes_per_param


def zero_model_state_bytes(num_params: int, *, stage: int, dp: int,
                           precision: str = "bf16_weights",
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


def fsdp2_all_gather_bytes(num_params: int, *, zero_stage: int, root_params: int,
                           micro_batches: int = 1, element_bytes: int = 4) -> int:
    """The bytes FSDP2's all-gathers deliver to one rank in one step (nccl-tests' S: each output,
    every rank's shard together) for Ψ = `num_params` (this rank's tensor-parallel share):
    every unit gathered whole once a micro-batch under ZeRO-2 (resharded after the backward);
    under ZeRO-3 each block twice (for the forward and again for the backward) and the root unit
    (`root_params`, `root_unit_params`: no default, which would count it twice) once, since
    FSDP2 does not reshard the root after the forward. Each element in `element_bytes` (the
    parameters' dtype). Padding of a shard's rows to a multiple of the ranks is not counted. 0
    below stage 2 (no all-gather of parameters)."""
    if zero_stage < 2:
        return 0
    gathered = num_params if zero_stage == 2 else 2 * num_params - root_params
    return micro_batches * gathered * element_bytes


def root_unit_params(m: ModelConfig, vocab: int | None = None, d: int | None = None) -> int:
    """FSDP2's root unit as `apply_data_parallel` shards it: the embedding, the final norm and
    the head (both V·d matrices unless tied; GPT-2's learned positions and its norm's bias too).
    `vocab`, `d`: a tensor-parallel rank's share (default: the model's)."""
    vocab, d, gpt2 = vocab or m.vocab_size, d or m.hidden_size, m.arch == "gpt2"
    return vocab * d * (1 if m.tie_embeddings else 2) + d * (2 if gpt2 else 1) \
        + (m.max_seq_len * d if gpt2 else 0)


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
    them, on this rank's tensor-parallel share (`root_unit_params`)."""
    return root_unit_params(r.m, r.shape.vocab, r.shape.d), layer_params(r.m, r.shape)[0]


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
        return r.prec.gathered * root
    gathered = root + layer * (1 + (block < num_layers - 1))
    return r.prec.gathered * gathered + r.prec.grad * layer * (block > 0)  # reduced in grad's dtype


def _fsdp2_forward_gathers(r: _Run) -> int:
    """FSDP2's ZeRO-3 all-gathers as a forward starts: the root unit's flat all-gather output
    beside the unsharded parameters it is copied out to, and the same for the first block
    (forward prefetch). The largest moment of the forward when the activations are small
    (recomputation) and the gradient shards of earlier micro-batches are held. 0 elsewhere."""
    if not (r.fsdp2_sharded and r.zero_stage >= 3 and r.pp == 1):
        return 0
    root, layer = _fsdp2_units(r)
    return 2 * r.prec.gathered * (root + layer)


def _fsdp2_root_reduce(r: _Run, grad_shards: int) -> int:
    """FSDP2's last reduce-scatter, the root unit's, once the backward is done (its
    post-backward, when the embedding's gradient is made): every gradient shard
    (`grad_shards`, the root's new one among them) and, when accumulating, the root's shard
    from the micro-batches before; one vocabulary matrix's whole gradient; and the root's
    reduce-scatter input in the reduce dtype. 0 outside FSDP2. Measured on gloo ranks at the
    peak (tiny, 2 layers, bf16 under FSDP2's policy and fp32, 2 micro-batches): these
    tensors, byte for byte."""
    if not (r.fsdp2_sharded and r.pp == 1):
        return 0
    root, _ = _fsdp2_units(r)
    earlier = r.prec.grad * -(-root // r.dp) if r.accumulation_steps > 1 else 0
    return grad_shards + earlier + r.prec.whole_grad * r.shape.vocab * r.shape.d + r.prec.grad * root
