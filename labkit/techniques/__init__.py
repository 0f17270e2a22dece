"""Technique families, one module each. Each module is an experiment (see `labkit.workload`),
registered here, once, with its notebook; `record(name)` is what every caller reads about it."""
from __future__ import annotations

import importlib
from types import ModuleType

from pathlib import Path

from labkit.config import ConfigError, register_sizes
from labkit.techniques.record import Experiment, from_module

# name -> (module, notebook from the repository root, or None): the one place experiments are
# registered. The order is the lab's (`labkit list`, the lab plan).
REGISTRY: dict[str, tuple[str, str | None]] = {
    "mixed_precision": ("labkit.techniques.mixed_precision", "notebooks/01_mixed_precision.ipynb"),
    "kv_cache": ("labkit.techniques.kv_cache", "notebooks/02_kv_cache.ipynb"),
    "weight_quant": ("labkit.techniques.weight_quant", "notebooks/27_weight_quant.ipynb"),
    "speculative": ("labkit.techniques.speculative", "notebooks/28_speculative.ipynb"),
    "batching": ("labkit.techniques.batching", "notebooks/16_batching.ipynb"),
    "sla": ("labkit.techniques.sla", "notebooks/29_sla.ipynb"),
    "checkpointing": ("labkit.techniques.checkpointing", "notebooks/03_checkpointing.ipynb"),
    "grad_accumulation": ("labkit.techniques.grad_accumulation", "notebooks/04_grad_accumulation.ipynb"),
    "offload": ("labkit.techniques.offload", "notebooks/05_offload.ipynb"),
    "memory_pool": ("labkit.techniques.memory_pool", "notebooks/06_memory_pool.ipynb"),
    "batch_finder": ("labkit.techniques.batch_finder", "notebooks/07_batch_finder.ipynb"),
    "collectives": ("labkit.techniques.collectives", "notebooks/09_collectives.ipynb"),
    "data_parallel": ("labkit.techniques.data_parallel", "notebooks/10_data_parallel.ipynb"),
    "zero": ("labkit.techniques.zero", "notebooks/11_zero.ipynb"),
    "tensor_parallel": ("labkit.techniques.tensor_parallel", "notebooks/12_tensor_parallel.ipynb"),
    "pipeline_parallel": ("labkit.techniques.pipeline_parallel", "notebooks/13_pipeline_parallel.ipynb"),
    "hybrid": ("labkit.techniques.hybrid", "notebooks/14_hybrid.ipynb"),
    "recipe": ("labkit.techniques.recipe", "notebooks/26_recipe.ipynb"),
    "finetune": ("labkit.techniques.finetune", "notebooks/30_finetune.ipynb"),
    "packing": ("labkit.techniques.packing", "notebooks/31_packing.ipynb"),
    "fp8": ("labkit.techniques.fp8", "notebooks/32_fp8.ipynb"),
    "moe": ("labkit.techniques.moe", "notebooks/34_moe.ipynb"),
    "context_parallel": ("labkit.techniques.context_parallel", "notebooks/33_context_parallel.ipynb"),
    "grad_compression": ("labkit.techniques.grad_compression", "notebooks/35_grad_compression.ipynb"),
    "load_balance": ("labkit.techniques.load_balance", "notebooks/15_load_balance.ipynb"),
    "attention": ("labkit.techniques.attention", "notebooks/17_attention.ipynb"),
    "compile": ("labkit.techniques.compiling", "notebooks/18_compile.ipynb"),
    "fused_kernel": ("labkit.techniques.fused_kernel", "notebooks/19_fused_kernel.ipynb"),
    "matmul": ("labkit.techniques.matmul", "notebooks/20_matmul.ipynb"),
    "memory_access": ("labkit.techniques.memory_access", "notebooks/21_memory_access.ipynb"),
    "profiling": ("labkit.techniques.profiling", "notebooks/22_profiling.ipynb"),
    "dataloading": ("labkit.techniques.dataloading", "notebooks/23_dataloading.ipynb"),
    "threads": ("labkit.techniques.threads", "notebooks/24_threads.ipynb"),
}
EXPERIMENTS = {name: module for name, (module, _) in REGISTRY.items()}  # name -> module path


def _check_name(name: str) -> None:
    if name not in REGISTRY:
        raise ConfigError(f"unknown experiment {name!r}; valid: {', '.join(REGISTRY)}")


def get_experiment(name: str) -> ModuleType:
    """The experiment module called `name`, or a ConfigError naming the valid ones."""
    _check_name(name)
    return importlib.import_module(EXPERIMENTS[name])


def record(name: str) -> Experiment:
    """The record of experiment `name`, or a ConfigError naming the valid ones. A module that
    breaks the contract fails here with an ImportError saying how.

    Built when asked for, from the module as it is then: importing every technique (about a second)
    is paid only by callers that want them all (`labkit list`, the lab plan), not by each run or
    rank; and reading the names is cheap, so a function patched on the module (a test's
    monkeypatch) is the one the harness calls, as when it read the module itself."""
    _check_name(name)
    return from_module(name, get_experiment(name), REGISTRY[name][1])


def records() -> dict[str, Experiment]:
    """Every experiment's record, in the lab's order."""
    return {name: record(name) for name in REGISTRY}


def by_notebook() -> dict[str, Experiment]:
    """The experiment each experiment notebook belongs to, by notebook stem (its record's
    `notebook`); the other notebooks (00_environment, 08_memory_planner, ...) are not in it."""
    return {stem: record(name) for stem, name in notebook_names().items()}


def notebook_names() -> dict[str, str]:
    """Notebook stem -> experiment name, from the registry alone (no module is imported)."""
    return {Path(nb).stem: name for name, (_, nb) in REGISTRY.items() if nb}


def _sizes(experiment: str, preset: str) -> dict:
    """An experiment's own sizes at `preset` (its module's SIZES); none for an unknown name."""
    return record(experiment).sizes.get(preset, {}) if experiment in REGISTRY else {}


register_sizes(_sizes)  # config.resolve reads each experiment's sizes through this


def __getattr__(attr: str):
    """`RECORDS`: records(), built when read (a PEP 562 module attribute, so that importing this
    package does not import every technique)."""
    if attr == "RECORDS":
        return records()
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")
