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
    dimensions built even when they are 1."""

    dp: int = 1
    tp: int = 1
    data_parallel: str = "none"
    device: str = "cpu"
    offload: str = "none"
    always: tuple[str, ...] = ()
    cp: int = 1

    @classmethod
    def of(cls, recipe, world: int, device: str = "cpu") -> "Layout":
        """A recipe's layout on `world` ranks: TP groups of `recipe.tensor_parallel`, CP groups
        of `recipe.context_parallel` of them, the rest data-parallel replicas; the gradients
        reduced over dp x cp at `recipe.zero_stage`."""
        tp, cp = recipe.tensor_parallel, recipe.context_parallel
        if world % (tp * cp):
            degrees = f"tensor_parallel={tp}" + (f" x context_parallel={cp}" if cp > 1 else "")
            raise ConfigError(f"{degrees} does not divide the {world} ranks")
        dp = world // (tp * cp)
        return cls(dp, tp, data_mode(recipe.zero_stage, dp * cp), device, recipe.offload, cp=cp)

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp

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
    def fsdp_enabled(self) -> bool:
        return self.dp_enabled and self.data_parallel in SHARDED

    @property
    def host_optimizer(self) -> bool:
        return self.offload in HOST_OPTIMIZER

    @property
    def dims(self) -> dict[str, int]:
        """The mesh's named dimensions: each that splits the ranks, and each in `always` (a
        sharded path checked on one rank still shards over a mesh of one)."""
        return {name: size for name, size in (("dp", self.dp), ("cp", self.cp), ("tp", self.tp))
                if size > 1 or name in self.always}

    @functools.cached_property
    def mesh(self) -> DeviceMesh | None:
        """The mesh of `dims`, built once (None: no dimension); with both dp and cp, their
        flattened `dp_cp` dimension too (DeviceMesh._flatten, as torchtitan builds it)."""
        if not self.dims:
            return None
        mesh = init_device_mesh(torch.device(self.device).type, tuple(self.dims.values()),
                                mesh_dim_names=tuple(self.dims))
        if "dp" in self.dims and "cp" in self.dims:
            mesh["dp", "cp"]._flatten("dp_cp")
        return mesh

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        return self.mesh["dp"] if "dp" in self.dims else None

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        return self.mesh["tp"] if "tp" in self.dims else None

    @property
    def cp_mesh(self) -> DeviceMesh | None:
        return self.mesh["cp"] if "cp" in self.dims else None

    @property
    def dp_cp_mesh(self) -> DeviceMesh | None:
        """The ranks the data-parallel wrappers reduce over: dp and cp flattened (rank d·cp + c
        of it is replica d's c-th sequence shard), or whichever of the two there is."""
        if "cp" not in self.dims:
            return self.dp_mesh
        return self.mesh["dp_cp"] if "dp" in self.dims else self.cp_mesh
