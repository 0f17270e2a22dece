"""The package's shape: few modules at the top, layers in sub-packages, and the old import paths
still working (each is the moved module itself, not a copy)."""
import importlib
import os
from pathlib import Path

import pytest

import labkit

TOP = Path(labkit.__file__).parent
# old path -> where the module lives now
MOVED = {"labkit.model": "labkit.blocks.model", "labkit.reference": "labkit.blocks.reference",
         "labkit.experiment": "labkit.harness.experiment",
         "labkit.techniques.kv_caches": "labkit.blocks.kv_caches"}


def test_at_most_ten_modules_directly_in_labkit():
    modules = sorted(p.stem for p in TOP.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(modules) <= 10, modules


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_an_old_import_path_is_the_moved_module(old, new):
    assert importlib.import_module(old) is importlib.import_module(new)


def test_the_names_users_import_keep_working():
    from labkit.config import MODELS
    from labkit.experiment import run_experiment
    from labkit.model import build_model, num_params
    from labkit.reference import heldout, load_reference
    from labkit.techniques.kv_cache import generate_cached, generate_uncached
    from labkit.techniques.kv_caches import DynamicCache, StaticCache
    from labkit.harness.experiment import run_experiment as moved
    assert run_experiment is moved and "llama-2-7b" in MODELS
    assert all(callable(f) for f in (build_model, num_params, heldout, load_reference,
                                     generate_cached, generate_uncached))
    assert DynamicCache.__module__ == StaticCache.__module__ == "labkit.blocks.kv_caches"


# helpers two experiments share, moved from an experiment to labkit.blocks: experiment -> (block,
# names still importable from the experiment, each the block's own object)
SHARED = {"kv_cache": ("decoding", ("load_model", "generate_cached", "generate_uncached")),
          "batching": ("replay", ("workload", "workload_spec", "texts", "make_engine", "policy",
                                  "num_slots", "longest", "summary", "prefill_rows", "quantile",
                                  "prefix_savings", "shared_prefix_fraction", "prompts_of",
                                  "predicted_steps", "WORKLOADS_DIR")),
          "tensor_parallel": ("sharded", ("build_sharded_step", "backward", "train_step", "grads",
                                          "full_grads", "check_tp_shape", "corrupt_row_outputs")),
          "zero": ("sharded", ("full_tensor",)),
          "mixed_precision": ("transforms", ("compute_dtype",)),
          "collectives": ("distributed", ("link_gbps",)),
          "batch_finder": ("search", ("find_largest", "Search"))}


@pytest.mark.parametrize("experiment", sorted(SHARED))
def test_a_shared_helper_keeps_its_old_import_path(experiment):
    block, names = SHARED[experiment]
    old = importlib.import_module(f"labkit.techniques.{experiment}")
    new = importlib.import_module(f"labkit.blocks.{block}")
    assert all(getattr(old, name) is getattr(new, name) for name in names)


def test_the_experiments_shared_constants_and_contract_pieces_are_the_blocks_own():
    from labkit.blocks import replay, sharded, transforms
    from labkit.techniques import batching, hybrid, mixed_precision, sla, tensor_parallel
    assert mixed_precision.TOLERANCE is transforms.PRECISION_TOLERANCE  # one dict: patched once
    assert tensor_parallel.TOLERANCE == hybrid.TOLERANCE == sharded.TP_TOLERANCE
    assert batching.Config is replay.ServingConfig and issubclass(sla.Config, batching.Config)
    assert (batching.validate, batching.compare, batching.expected) == (
        replay.validate_replay, replay.compare_replays, replay.expected_replay)
    assert sla.VARIANTS == batching.VARIANTS == replay.SCHEDULERS


def test_no_step_side_technique_subclasses_the_training_step():
    """The techniques change a training step through transforms (labkit.blocks.transforms), or
    compose it, never by overriding its hooks."""
    import labkit.blocks.training as training
    from labkit.techniques import REGISTRY, get_experiment
    subclasses = [f"{name}.{obj.__name__}" for name in REGISTRY
                  for obj in vars(get_experiment(name)).values()
                  if isinstance(obj, type) and issubclass(obj, training.Trainer)
                  and obj is not training.Trainer]
    assert subclasses == []


def test_a_test_file_is_one_unit_of_work_for_the_two_workers(request):
    """Under pytest-xdist (the README's command) every test carries its file's group in its id,
    which is what the scheduler splits the suite by: a file's module fixtures (a launch of ranks)
    then run once. pytest 9.2's node ids lose the group (pytest-dev/pytest-xdist#1386)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("run without pytest-xdist's workers (-n 0 or -p no:xdist)")
    assert request.node.nodeid.endswith("@" + Path(__file__).name)
