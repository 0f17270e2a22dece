"""Technique families, one module each. Each module is an experiment (see `labkit.workload`)."""
from __future__ import annotations

import importlib
from types import ModuleType

from labkit.config import ConfigError

EXPERIMENTS = {
    "mixed_precision": "labkit.techniques.mixed_precision",
    "kv_cache": "labkit.techniques.kv_cache",
    "batching": "labkit.techniques.batching",
    "checkpointing": "labkit.techniques.checkpointing",
    "grad_accumulation": "labkit.techniques.grad_accumulation",
    "offload": "labkit.techniques.offload",
    "memory_pool": "labkit.techniques.memory_pool",
    "batch_finder": "labkit.techniques.batch_finder",
    "collectives": "labkit.techniques.collectives",
    "data_parallel": "labkit.techniques.data_parallel",
    "zero": "labkit.techniques.zero",
    "tensor_parallel": "labkit.techniques.tensor_parallel",
    "pipeline_parallel": "labkit.techniques.pipeline_parallel",
    "hybrid": "labkit.techniques.hybrid",
    "load_balance": "labkit.techniques.load_balance",
    "attention": "labkit.techniques.attention",
    "compile": "labkit.techniques.compiling",
    "fused_kernel": "labkit.techniques.fused_kernel",
    "matmul": "labkit.techniques.matmul",
    "memory_access": "labkit.techniques.memory_access",
    "profiling": "labkit.techniques.profiling",
    "dataloading": "labkit.techniques.dataloading",
    "threads": "labkit.techniques.threads",
}


def get_experiment(name: str) -> ModuleType:
    """The experiment module called `name`, or a ConfigError naming the valid ones."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}")
    return importlib.import_module(EXPERIMENTS[name])
