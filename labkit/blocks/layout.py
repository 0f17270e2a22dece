"""How a run's ranks split, and where its model states live: `dp` data-parallel replicas, each
`cp` context-parallel ranks (every sequence split along its tokens) of `tp`-rank tensor-parallel
groups, in the manner of torchtitan's `ParallelDims` (world = dp x cp x tp, in that order).

    layout = Layout.of(recipe, world, device)
    if layout.tp_enabled:
        apply_tensor_parallel(trainer, layout.tp_mesh)

The rank product is checked once, where the layout is made (`of`); the device mesh is built once,
on first use, by the one `init_device_mesh` call in labkit. Tensor parallelism is the inner
dimension, so a TP group is neighbouring ranks (one node's fast links, on GPUs). The dp x cp
ranks each compute a different share of the global batch's tokens: the data-parallel wrappers
reduce the gradients over all of them (`dp_cp_mesh`, as torchtitan's FSDP shards over dp_cp).

Expert parallelism borrows the data-parallel ranks (torchtitan borrows dp_shard x cp; labkit dp
alone): the dp dimension is built as (dp_mod_ep, ep), ep the inner one, and flattened back to dp.
An `ep_mesh` group (neighbouring replicas) splits each MoE layer's experts; the `dp_mod_ep`
ranks, one in each ep group, hold the same experts and alone reduce their gradients.

Pipeline parallelism is the outermost dimension (torchtitan's order: pp, dp, cp, tp): `pp`
groups of world / pp ranks each hold a run of the model's stages, so a pp group (the ranks one
micro-batch passes through) is ranks d, d + dp, ... (`labkit.blocks.pipeline_recipe`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from labkit.config import ConfigError

ZERO_MODES = ("ddp", "zero1", "zero2", "zero3")  # what each ZeRO stage builds over the replicas
SHARDED = ("zero2", "zero3")  # the data-parallel modes FSDP2 builds
HOST_OPTIMIZER = ("optimizer", "both")  # the offload modes that step the optimizer on the host


def data_mode(zero_stage: int, replicas: int) -> str:
    """The data parallelism of `replicas` model replicas at `zero_stage`: none for one replica,
    else DDP (stage 0), DDP with ZeroRedundancyOptimizer (1), FSDP2 (2 and 3)."""
    return ZERO_MODES[zero_stage] if replicas > 1 else "none"


@dataclass(frozen=True)
class Layout:
    """`dp` replicas of `cp` context-parallel ranks of `tp`-rank tensor-parallel groups on
    `device`; the gradients reduced over the dp x cp ranks by `data_parallel` (ddp, zero1, zero2,
    zero3, or none); the optimizer's states offloaded as `offload` says; `always`: mesh
    dimensions built even when they are 1; `ep`: the replicas in each expert-parallel group."""

    dp: int = 1
    tp: int = 1
    data_parallel: str = "none"
    device: str = "cpu"
    offload: str = "none"
    always: tuple[str, ...] = ()
    cp: int = 1
    ep: int = 1
    pp: int = 1

    @classmethod
    def of(cls, recipe, world: int, device: str = "cpu") -> "Layout":
        """A recipe's layout on `world` ranks: TP groups of `recipe.tensor_parallel`, CP groups
        of `recipe.context_parallel` of them, the rest data-parallel replicas (in expert-parallel
        groups of `recipe.expert_parallel`); the gradients reduced over dp x cp at
        `recipe.zero_stage`."""
        tp, cp, pp = recipe.tensor_parallel, recipe.context_parallel, recipe.pipeline_parallel
        if world % (pp * tp * cp):
            degrees = ((f"pipeline_parallel={pp} x " if pp > 1 else "") + f"tensor_parallel={tp}"
                       + (f" x context_parallel={cp}" if cp > 1 else ""))
            raise ConfigError(f"{degrees} does not divide the {world} ranks")
        dp, ep = world // (pp * tp * cp), recipe.expert_parallel
        if dp % ep:
            raise ConfigError(f"expert_parallel={ep} does not divide the {dp} data-parallel replicas")
        return cls(dp, tp, data_mode(recipe.zero_stage, dp * cp), device, recipe.offload, cp=cp, ep=ep,
                   pp=pp)

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def dp_cp(self) -> int:
        """The ranks that split the global batch's tokens: rows over dp, each row's over cp."""
        return self.dp * self.cp

    @property
    def dp_enabled(self) -> bool:
        """Whether a data-parallel wrapper reduces the gradients (over the dp x cp ranks)."""
        return self.dp_cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_enabled and self.data_parallel in SHARDED

    @property
    def host_optimizer(self) -> bool:
        return self.offload in HOST_OPTIMIZER

    @property
    def dims(self) -> dict[str, int]:
        """The mesh's named dimensions: each that splits the ranks, and each in `always` (a
        sharded path checked on one rank still shards over a mesh of one)."""
        # with ep, dp built as (dp_mod_ep, ep), both kept at any size, flattened back by `meshes`
        data = ((("dp_mod_ep", self.dp // self.ep), ("ep", self.ep)) if self.ep > 1
                else (("dp", self.dp),))
        return {name: size for name, size in (("pp", self.pp), *data, ("cp", self.cp), ("tp", self.tp))
                if size > 1 or name in self.always or name in ("dp_mod_ep", "ep")}

    @functools.cached_property
    def meshes(self) -> dict[str, DeviceMesh]:
        """The mesh of `dims` ("root"), built once (empty: no dimension), and each of its named
        dimensions; with ep, dp flattened from (dp_mod_ep, ep); with dp and cp, their flattened
        `dp_cp` too (DeviceMesh._flatten, as torchtitan builds them; kept here, as torch asks,
        rather than sliced from the root again)."""
        if not self.dims:
            return {}
        mesh = init_device_mesh(torch.device(self.device).type, tuple(self.dims.values()),
                                mesh_dim_names=tuple(self.dims))
        out = {"root": mesh, **{name: mesh[name] for name in self.dims}}
        data = ("dp_mod_ep", "ep") if self.ep > 1 else ("dp",)
        if self.ep > 1:
            out["dp"] = mesh[data]._flatten("dp")
        if "dp" in out and "cp" in out:
            out["dp_cp"] = mesh[(*data, "cp")]._flatten("dp_cp")
        return out

    @property
    def mesh(self) -> DeviceMesh | None:
        return self.meshes.get("root")

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return self.meshes.get("dp")

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The expert-parallel group: ep neighbouring replicas, each holding 1/ep of the experts."""
        return self.meshes.get("ep")

    @property
    def ep_replicas_mesh(self) -> DeviceMesh | None:
        """The dp / ep ranks that hold the same experts (one in each ep group)."""
        return self.meshes.get("dp_mod_ep")

    @property
    def pp_mesh(self) -> DeviceMesh | None:
        """The pipeline group: the pp ranks one micro-batch passes through, a stage each."""
        return self.meshes.get("pp")

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.meshes.get("tp")

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self.meshes.get("cp")

    @property
    def dp_cp_mesh(self) -> DeviceMesh | None:
        """The ranks the data-parallel wrappers reduce over: dp and cp flattened (rank d·cp + c
        of it is replica d's c-th sequence shard), or whichever of the two there is."""
        meshes = self.meshes
        return meshes.get("dp_cp", meshes.get("dp", meshes.get("cp")))
