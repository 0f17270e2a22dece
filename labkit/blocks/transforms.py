"""The step-side techniques as transforms of a training step (`labkit.blocks.training.Trainer`):
each `apply_*` changes one part of the step (the model, what the forward runs under, the
micro-batches, the optimizer it will build) and returns the trainer. `compose` (in
`labkit.blocks.recipe`) applies a recipe's transforms in one fixed order; the single-technique
experiments apply the same functions, so every technique has one implementation.

- `apply_precision`: autocast (bf16, fp16 with a GradScaler), TF32 matmuls, or bf16 weights with
  fp32 master copies in the optimizer. Before the optimizer is built. `compute_dtype` names the
  dtype a precision computes in, `PRECISION_TOLERANCE` the loss difference from fp32 it may show.
- `apply_tensor_parallel`: Megatron's split of every block over a 1-D device mesh (DTensors).
- `apply_checkpointing`: chosen blocks recompute their forward in the backward.
- `apply_compile`: `torch.compile` of each block, in place (parameter names unchanged).
- `apply_data_parallel`: DDP, ZeroRedundancyOptimizer (ZeRO-1) or FSDP2 (ZeRO-2/3), and this
  rank's slice of the global batch.
- `apply_accumulation`: one optimizer step over several micro-batches.
- `apply_offload`: saved activations and/or the optimizer's states in host memory.
- `apply_optimizer`: AdamW with 8- or 4-bit moments in place of fp32 ones.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from labkit import planner
from labkit.blocks import losses, optimizers
from labkit.blocks.layout import SHARDED, Layout
from labkit.blocks.model import Decoder
from labkit.blocks.training import CopyAdamW, Trainer
from labkit.measure.modes import unmetered

aten = torch.ops.aten

# --- precision ------------------------------------------------------------------------------------

PRECISIONS = ("fp32", "tf32", "bf16", "fp16", "bf16_weights")
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Relative loss difference against fp32 after the same steps that still counts as a match.
PRECISION_TOLERANCE = {"fp32": 0.0, "tf32": 0.01, "fp16": 0.02, "bf16": 0.05, "bf16_weights": 0.05}


@contextlib.contextmanager
def tf32_matmuls():
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # "high" = TF32 tensor cores for fp32 matmuls
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def master_adamw(params, lr: float) -> CopyAdamW:
    """AdamW on fp32 master copies of 16-bit weights: grads upcast, the update made in fp32 and
    rounded back into the weights."""
    return CopyAdamW(params, lr, dtype=torch.float32)


def weights_dtype(precision: str) -> torch.dtype:
    return torch.bfloat16 if precision == "bf16_weights" else torch.float32


def compute_dtype(precision: str) -> str:
    return {"fp16": "float16", "bf16": "bfloat16", "bf16_weights": "bfloat16",
            "tf32": "tf32"}.get(precision, "float32")


def apply_precision(trainer: Trainer, precision: str, *, loss_scaling: bool = True) -> Trainer:
    """The forward under the precision's autocast (or TF32 matmuls); `bf16_weights` casts the
    weights and makes the optimizer keep fp32 master copies; fp16 scales the loss (GradScaler)
    unless `loss_scaling` is off."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
    device_type = torch.device(trainer.cfg.device).type
    if precision in AUTOCAST:
        trainer.contexts.append(functools.partial(torch.autocast, device_type, dtype=AUTOCAST[precision]))
    elif precision == "tf32":
        trainer.contexts.append(tf32_matmuls)
    elif precision == "bf16_weights":
        trainer.model.to(torch.bfloat16)
        trainer.optimizer_factory = master_adamw
    if precision == "fp16" and loss_scaling:
        trainer.scaler = torch.amp.GradScaler(device_type)
    return trainer


# --- model converters: what trains, and how the base is stored -----------------------------------

FINETUNE = ("none", *planner.FINETUNE_METHODS[1:])  # the planner's methods, full aside


def apply_finetune(trainer: Trainer, method: str, *, rank: int = 8, alpha: float = 16.0,
                   targets: tuple[str, ...] = ("q", "v")) -> Trainer:
    """The model converted in place (torchtitan's model converters): `lora` freezes the base and
    puts rank-`rank` adapters on the `targets` linears (PEFT); `qlora` first stores the base's
    block linears in NF4 (torchao), `lora_int8` and `lora_int4` in int8 or int4 (weight-only,
    labkit.blocks.quant), from the weights in their dtype, which is what they dequantize to.
    The optimizer, built later, keeps state for the adapters alone (`Trainer.build_optimizer`:
    what requires grad)."""
    if method not in FINETUNE:
        raise ValueError(f"unknown finetune {method!r}; valid: {', '.join(FINETUNE)}")
    if method == "none":
        return trainer
    from labkit.blocks import lora  # PEFT and torchao: the finetune extra

    lora.quantize_base(trainer.model, method)
    lora.apply_lora(trainer.model, targets, rank=rank, alpha=alpha)
    return trainer


def apply_loss(trainer: Trainer, mode: str, chunk: int) -> Trainer:
    """`chunked`: the model computes its loss with the head fused in, `chunk` tokens of logits at
    a time (`labkit.blocks.losses`); `plain`: the whole logits, then the loss."""
    if mode not in losses.LOSSES:
        raise ValueError(f"unknown loss {mode!r}; valid: {', '.join(losses.LOSSES)}")
    trainer.model.loss_chunk = chunk if mode == "chunked" else 0
    return trainer


def apply_optimizer(trainer: Trainer, name: str) -> Trainer:
    """`adamw8bit`, `adamw4bit`: AdamW with block-quantized moments (`labkit.blocks.optimizers`),
    its update compiled on a GPU and eager elsewhere; `adamw`: torch's."""
    if name not in optimizers.OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(optimizers.OPTIMIZERS)}")
    if name != "adamw":
        trainer.optimizer_factory = functools.partial(
            optimizers.low_bit_adamw, optimizer=name, compiled=trainer.cfg.device.startswith("cuda"))
    return trainer


# --- tensor parallel ------------------------------------------------------------------------------

def block_plan(block: torch.nn.Module, seq, sequence_parallel: bool) -> dict:
    """One block's plan; `seq` is the residual stream's layout between blocks. PrepareModuleInput
    makes the attention (and MLP) input one Replicate DTensor, so wq, wk and wv share it and its
    gradient is reduced once per module (Megatron's "f"), not once per projection."""
    rest = (None,) * 4  # Attention.forward(x, start_pos, cache, impl, rope): only x is sharded
    plan = {
        "attn": PrepareModuleInput(input_layouts=(seq, *rest), desired_input_layouts=(Replicate(), *rest)),
        "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(output_layouts=seq),
        "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "mlp.w1": ColwiseParallel(), "mlp.w2": RowwiseParallel(output_layouts=seq),
    }
    if hasattr(block.mlp, "w3"):  # SwiGLU's gate: split like w1
        plan["mlp.w3"] = ColwiseParallel()
    if sequence_parallel:  # the norms run on this rank's tokens; their weights stay replicated
        plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
    return plan


def apply_tp(model: torch.nn.Module, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> torch.nn.Module:
    """Shard the plain decoder in place over the 1-D `mesh` (Megatron's split: attention heads and
    the MLP's hidden units column-wise, their output projections row-wise); with
    `sequence_parallel` the norms and the residual stream are split by tokens."""
    seq = Shard(1) if sequence_parallel else Replicate()  # (B, T, d): Shard(1) splits T
    top = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
           # the logits gathered on every rank (b*s*V): the loss stays the plain cross-entropy
           "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Replicate())}
    if sequence_parallel:
        top["norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers:
        parallelize_module(block, mesh, block_plan(block, seq, sequence_parallel))
    return model


def apply_tensor_parallel(trainer: Trainer, mesh: DeviceMesh, *, sequence_parallel: bool = False) -> Trainer:
    """The step's model sharded over `mesh`; every rank of it runs the same batch. Before each
    update every gradient is laid out as its parameter (`match_grad_placements`)."""
    apply_tp(trainer.model, mesh, sequence_parallel=sequence_parallel)
    trainer.grad_hooks.append(lambda s: match_grad_placements(s.model))
    return trainer


def match_grad_placements(model: torch.nn.Module) -> None:
    """Lay every gradient out as its parameter, once, after backward. Two come out otherwise:
    - with sequence parallelism a norm weight's gradient covers only this rank's tokens (Partial):
      one all-reduce here (as Megatron does), where AdamW would all-reduce it in each op reading it;
    - the vocab-parallel embedding's gradient comes out whole (Replicate, V x d on every rank: its
      inputs, the token ids and the output gradient, are replicated): keeping this rank's rows is
      a local slice, and frees (n-1)/n of it."""
    for p in model.parameters():
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


# --- activation checkpointing ---------------------------------------------------------------------

CHECKPOINT_MODES = ("none", "full", "every_n", "selective", "blocks")
# Ops whose outputs selective checkpointing keeps: the matmuls (and attention) hold the FLOPs.
SAVED_BY_SELECTIVE = {aten.mm.default, aten.addmm.default, aten.bmm.default,
                      aten._scaled_dot_product_flash_attention_for_cpu.default,
                      aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default}


def _selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed_blocks(num_layers: int, mode: str, *, every: int = 2,
                        blocks: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Indices of the blocks a mode wraps."""
    if mode == "none":
        return ()
    if mode == "every_n":
        return tuple(range(0, num_layers, every))
    if mode == "blocks":
        return tuple(sorted(set(blocks)))
    return tuple(range(num_layers))


def apply_checkpointing(target: Trainer | Decoder, mode: str, *, every: int = 2,
                        blocks: tuple[int, ...] = ()):
    """Wrap the chosen blocks' forward in non-reentrant `torch.utils.checkpoint`, in place, on a
    training step's model or on a bare model; returns what it was given."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"unknown checkpointing mode {mode!r}; valid: {', '.join(CHECKPOINT_MODES)}")
    model = target.model if isinstance(target, Trainer) else target
    context_fn = (functools.partial(create_selective_checkpoint_contexts, _selective_policy)
                  if mode == "selective" else None)
    for i in checkpointed_blocks(len(model.layers), mode, every=every, blocks=blocks):
        block = model.layers[i]
        block.forward = _checkpointed(block.forward, context_fn)
    return target


def _checkpointed(forward, context_fn):
    options = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(forward)
    def run(*args, **kwargs):  # keywords (a packed batch's mask) go through to the block
        return checkpoint(forward, *args, use_reentrant=False, **options, **kwargs)

    return run


# --- compile --------------------------------------------------------------------------------------

def apply_compile(trainer: Trainer, mode: str | None = None) -> Trainer:
    """Each block compiled in place (`nn.Module.compile`: the module and its parameter names stay,
    unlike a `torch.compile` wrapper). Per block, as torchtitan does: the blocks are alike, so one
    graph serves them all, and data-parallel hooks between blocks stay outside the graphs. The
    compilation itself happens at the first forward."""
    for block in trainer.model.layers:
        block.compile(mode=mode)
    return trainer


# --- data parallel and ZeRO -----------------------------------------------------------------------

DATA_PARALLEL = ("none", "ddp", "zero1", "zero2", "zero3")


def zero1_adamw(params, lr: float, process_group=None) -> ZeroRedundancyOptimizer:
    """AdamW whose moments each rank keeps for its share of the parameter tensors (ZeRO-1)."""
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr,
                                   process_group=process_group)


def fsdp_mixed_precision(precision: str, kind: str) -> MixedPrecisionPolicy | None:
    """FSDP2's own mixed precision for a recipe's `precision` under data parallelism `kind`, in
    place of autocast (torchtitan's `mixed_precision_param`): for bf16 under zero2 and zero3,
    each unit gathered in bf16 (zero3: each block for the forward and again for the backward,
    the root once; zero2: once, kept to the backward), its forward and backward in bf16, the
    gradients reduced in fp32 into fp32 shards, which AdamW updates. None for the others: fp16
    keeps autocast and its GradScaler; DDP and ZeRO-1 (not FSDP2) keep autocast."""
    if precision != "bf16" or kind not in SHARDED:
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def shard_fully(model: torch.nn.Module, mesh: DeviceMesh, *, reshard_after_forward: bool | None = True,
                offload: bool = False, mp_policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """FSDP2 in place: one unit per block, then the root (embedding, final norm, head), which
    forms the last unit; each block's unit is gathered and freed on its own, which is what bounds
    the peak. `reshard_after_forward=None` is FSDP2's default: True for the blocks, False for the
    root. `offload`: the shards, their gradients and the optimizer step on the host. `mp_policy`:
    the dtypes it gathers and reduces in (`fsdp_mixed_precision`)."""
    kw = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model


def wrap_ddp(model: torch.nn.Module, device: str, *, bucket_cap_mb: float | None = None,
             gradient_as_bucket_view: bool = True, process_group=None) -> DistributedDataParallel:
    """DDP over `process_group` (None: every rank). By default the gradients are views of DDP's
    all-reduce buckets: one gradient-sized buffer, not two. `bucket_cap_mb`: DDP's bucket size
    (None: its 25 MiB)."""
    device_ids = [torch.device(device).index] if device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                                   gradient_as_bucket_view=gradient_as_bucket_view,
                                   process_group=process_group)


def apply_data_parallel(trainer: Trainer, kind: str, mesh: DeviceMesh | None = None, *,
                        offload: bool = False, bucket_cap_mb: float | None = None,
                        gradient_as_bucket_view: bool = True,
                        mp_policy: MixedPrecisionPolicy | None = None) -> Trainer:
    """Data parallelism over `mesh` (default: every rank): the step's batch is the global one, and
    each rank keeps its slice of it. `ddp` and `zero1` wrap the model in DDP over every rank
    (`zero1` with ZeroRedundancyOptimizer; `bucket_cap_mb` and `gradient_as_bucket_view` go to
    `wrap_ddp`); `zero2` and `zero3` shard it with FSDP2, `zero3` also regathering each block
    for the backward (not the root unit); `offload` keeps FSDP2's shards and optimizer on the
    host, `mp_policy` sets the dtypes it gathers and reduces in."""
    if kind not in DATA_PARALLEL:
        raise ValueError(f"unknown data parallel {kind!r}; valid: {', '.join(DATA_PARALLEL)}")
    if kind == "none":
        return trainer
    sharded = kind in ("zero2", "zero3")
    if mesh is None and sharded:  # DDP needs no mesh: it runs on the default process group
        mesh = Layout(dist.get_world_size(), 1, kind, trainer.cfg.device, always=("dp",)).dp_mesh
    n, r = ((mesh.size(), mesh.get_local_rank()) if mesh is not None
            else (dist.get_world_size(), dist.get_rank()))
    trainer.inputs, trainer.targets = trainer.inputs.chunk(n)[r], trainer.targets.chunk(n)[r]
    if trainer.document_ids is not None:
        trainer.document_ids = trainer.document_ids.chunk(n)[r]
    if trainer.loss_tokens is not None:  # the global mean: each rank weighs its tokens by n / all
        trainer.loss_tokens /= n
    trainer.sizes = [len(trainer.inputs)]
    if sharded:
        # zero3: FSDP2's default, which reshards each block after its forward but keeps the
        # root unit (whose backward comes first) gathered to its backward, as torchtitan does
        shard_fully(trainer.model, mesh, reshard_after_forward=None if kind == "zero3" else False,
                    offload=offload, mp_policy=mp_policy)
        return trainer
    group = mesh.get_group() if mesh is not None else None  # None: every rank
    trainer.net = wrap_ddp(trainer.model, trainer.cfg.device, bucket_cap_mb=bucket_cap_mb,
                           gradient_as_bucket_view=gradient_as_bucket_view, process_group=group)
    if kind == "zero1":
        trainer.optimizer_factory = functools.partial(zero1_adamw, process_group=group)
    return trainer


# --- accumulation and offload ---------------------------------------------------------------------

def apply_accumulation(trainer: Trainer, sizes: list[int]) -> Trainer:
    """One optimizer step over micro-batches of `sizes` sequences, consecutive rows of the step's
    batch: each micro-batch's activations are freed by its backward, its gradients add up."""
    if sum(sizes) != len(trainer.inputs) or min(sizes) < 1:
        raise ValueError(f"micro-batches {sizes} do not split the batch of {len(trainer.inputs)}")
    trainer.sizes = list(sizes)
    return trainer


class save_activations_on_host(torch.autograd.graph.saved_tensors_hooks):
    """`save_on_cpu(pin_memory=True)` for every saved tensor except the parameters (and views of
    them, such as a weight's transpose), which stay put; counts the bytes sent to the host.
    On a CPU `device` (where a virtual memory budget stands for a GPU's memory) the host copy is
    made `unmetered`: outside the budget's live-tensor tracker, as host memory is outside a GPU's."""

    def __init__(self, params, device: str = "cuda"):
        cuda = device.startswith("cuda")
        inner = torch.autograd.graph.save_on_cpu(pin_memory=True, device_type="cuda") if cuda else None
        resident = {p.untyped_storage().data_ptr() for p in params}
        self.bytes_to_host = 0

        def to_host(t: torch.Tensor):
            if inner is not None:
                return inner.pack_hook(t)  # (device, pinned host copy); copied asynchronously
            with unmetered():
                return t.detach().clone()

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() in resident:
                return t, None
            self.bytes_to_host += t.numel() * t.element_size()
            return None, to_host(t)

        def unpack(packed) -> torch.Tensor:
            t, host = packed
            if host is None:
                return t
            return inner.unpack_hook(host) if inner is not None else host.clone()  # back to its device

        super().__init__(pack, unpack)

    def counted(self):
        """The hooks, their count started again (what one forward sent)."""
        self.bytes_to_host = 0
        return self


def host_adamw(params, lr: float, device: str = "cuda") -> CopyAdamW:
    """AdamW whose state lives in host memory: the gradients copied into pinned host buffers,
    fp32 host copies of the weights updated there, the weights copied back. On a CPU `device`
    the host's copies, states and update are `unmetered` (outside a virtual budget's tracker)."""
    if device.startswith("cuda"):
        return CopyAdamW(params, lr, device="cpu", pin_memory=torch.cuda.is_available())
    with unmetered():
        return UnmeteredAdamW(params, lr, device="cpu")


class UnmeteredAdamW(CopyAdamW):
    """CopyAdamW whose update runs `unmetered`: the host of a CPU's virtual device."""

    def step(self) -> None:
        with unmetered():
            super().step()


def apply_offload(trainer: Trainer, *, activations: bool = False, optimizer: bool = False) -> Trainer:
    """Saved activations sent to host memory in the forward and back in the backward; the
    optimizer's states and update on the host."""
    device = str(trainer.cfg.device)
    if activations:
        trainer.host_hooks = save_activations_on_host(trainer.model.parameters(), device)
        trainer.contexts.append(trainer.host_hooks.counted)
    if optimizer:
        trainer.optimizer_factory = functools.partial(host_adamw, device=device)
    return trainer
