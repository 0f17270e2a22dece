import os

import pytest
import torch

from labkit import config
from labkit.config import (DTYPE_ALIASES, MODELS, PRESETS, ConfigError, RunConfig, expand_sweep,
                           parse_assignments, resolve, sweep_knobs, usable_threads)
from labkit.techniques import kv_cache, mixed_precision

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only behaviour")
ONE_GPU_AT_MOST = pytest.mark.skipif(torch.cuda.device_count() > 1, reason="cuda:1 is present")


def test_defaults_follow_the_preset_then_the_experiment_then_overrides():
    cfg = resolve(kv_cache.Config, "tiny", {"device": "cpu"}, experiment="kv_cache")
    assert (cfg.batch_size, cfg.prompt_len, cfg.new_tokens, cfg.num_threads) == (1, 16, 128, 1)
    assert cfg.device == "cpu" and cfg.model == MODELS["tiny"]
    cfg = resolve(kv_cache.Config, "tiny", {"batch_size": "3", "num_layers": "2", "device": "cpu"},
                  experiment="kv_cache")
    assert cfg.batch_size == 3 and cfg.model.num_layers == 2 and cfg.model.hidden_size == 256


def test_auto_device_and_preset_follow_the_machine():
    cfg = resolve(mixed_precision.Config)
    if torch.cuda.is_available():
        assert cfg.device == "cuda" and cfg.preset in ("small", "medium")
    else:
        assert cfg.device == "cpu" and cfg.preset == "tiny"


def test_typed_values_and_strings_both_work():
    a = resolve(RunConfig, "tiny", {"seq_len": 32, "memory_budget_gib": 0.5})
    b = resolve(RunConfig, "tiny", {"seq_len": "32", "memory_budget_gib": "0.5"})
    assert a == b and a.memory_budget_gib == 0.5
    assert resolve(RunConfig, "tiny", {"memory_budget_gib": "none"}).memory_budget_gib is None
    assert resolve(RunConfig, "tiny", {"dtype": "bf16"}).dtype == "bfloat16"


@pytest.mark.parametrize("overrides, words", [
    ({"bogus": 1}, ["unknown setting 'bogus'", "batch_size", "num_layers"]),
    ({"batch_size": "abc"}, ["batch_size", "int"]),
    ({"batch_size": 1.5}, ["batch_size", "int"]),
    ({"batch_size": 0}, ["batch_size=0", ">= 1"]),
    ({"batch_size": -2}, ["batch_size=-2", ">= 1"]),
    ({"seq_len": 4096}, ["seq_len=4096", "context (2048)"]),
    ({"dtype": "float64"}, ["unknown dtype 'float64'", "bfloat16"]),
    ({"device": "tpu"}, ["unknown device 'tpu'", "cpu"]),
    pytest.param({"device": "cuda"}, ["'cuda' is not present", "available: cpu"], marks=NO_GPU),
    pytest.param({"device": "cuda:1"}, ["not present"], marks=ONE_GPU_AT_MOST),
    ({"attention": "flash3"}, ["unknown attention", "sdpa, naive"]),
    ({"num_heads": 3}, ["multiple of num_heads"]),
    ({"memory_budget_gib": 0}, ["memory_budget_gib=0"]),
])
def test_bad_values_are_one_clear_error(overrides, words):
    with pytest.raises(ConfigError) as err:
        resolve(RunConfig, "tiny", overrides)
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_usable_threads_are_those_the_process_may_run_on():
    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert usable_threads() == expected >= 1


def test_num_threads_past_the_usable_threads_is_refused_naming_the_range(monkeypatch):
    monkeypatch.setattr(config, "usable_threads", lambda: 3)
    assert resolve(RunConfig, "tiny", {"num_threads": 3, "device": "cpu"}).num_threads == 3
    for value in (4, 100000):
        with pytest.raises(ConfigError, match=f"^num_threads={value} is out of range; valid: 1..3 "):
            resolve(RunConfig, "tiny", {"num_threads": str(value), "device": "cpu"})


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ConfigError, match="unknown preset 'gpt5'.*llama-3-8b"):
        resolve(RunConfig, "gpt5")


def test_generation_longer_than_the_context_is_refused():
    with pytest.raises(ConfigError, match="prompt_len \\+ new_tokens = 2049"):
        resolve(kv_cache.Config, "tiny", {"prompt_len": 2000, "new_tokens": 49})


def test_variant_choices_come_from_the_experiment():
    with pytest.raises(ConfigError, match="unknown variant 'beam'; valid: none, dynamic, static, "
                                          "paged, quantized"):
        resolve(kv_cache.Config, "tiny", {"variant": "beam"})


def test_every_preset_resolves_for_every_experiment():
    for preset in PRESETS:
        for exp in (kv_cache, mixed_precision):
            assert resolve(exp.Config, preset).model == MODELS[preset]


def test_assignments_and_sweeps():
    assert parse_assignments(["a=1", "b = x"]) == {"a": "1", "b": "x"}
    with pytest.raises(ConfigError, match="key=value"):
        parse_assignments(["novalue"])
    assert expand_sweep({"a": [1, 2], "b": ["x"]}) == [{"a": 1, "b": "x"}, {"a": 2, "b": "x"}]
    assert expand_sweep({}) == [{}]
    with pytest.raises(ConfigError, match="no values"):
        expand_sweep({"a": []})
    # a list of points: knobs that change together (a ladder's rungs), in order, nothing else
    rungs = [{"a": 1, "b": "x"}, {"a": 2, "b": "y"}]
    assert expand_sweep(rungs) == rungs and expand_sweep([]) == [{}]
    assert sweep_knobs(rungs) == sweep_knobs({"a": [1, 2], "b": ["x"]}) == {"a", "b"} and not sweep_knobs(None)
    with pytest.raises(ConfigError, match="holds points"):
        expand_sweep([{"a": 1}, 2])


def test_dtype_aliases_are_canonical():
    assert set(DTYPE_ALIASES.values()) == {"float32", "bfloat16", "float16"}


# The per-experiment sizes as config.PRESET_SIZES held them before they moved into each module's
# SIZES (issue 16): every resolved config must be what it was.
_OLD_GPU_DECODE = {"batch_size": 8, "prompt_len": 128, "new_tokens": 128, "dtype": "bfloat16"}
EXPERIMENTS_SINCE = ("weight_quant", "speculative", "sla", "packing", "fp8", "moe", "context_parallel",
                     "grad_compression")  # registered after the move (issue 18)
OLD_EXPERIMENT_SIZES = {
    "tiny": {"kv_cache": {"batch_size": 1}, "mixed_precision": {"batch_size": 2},
             "batching": {"batch_size": 8, "workload": "short", "kv_budget_tokens": 576},
             "attention": {"seq_len": 512}, "fused_kernel": {"rows": 4096},
             "batch_finder": {"memory_budget_gib": 0.2, "mode": "dynamic"},
             "hybrid": {"num_kv_heads": 4}, "pipeline_parallel": {"batch_size": 8}},
    "reference": {"kv_cache": {"batch_size": 1}},
    "small": {"kv_cache": _OLD_GPU_DECODE, "attention": {"dtype": "bfloat16"}},
    "medium": {"kv_cache": _OLD_GPU_DECODE, "attention": {"dtype": "bfloat16"}},
    "gpt2-124m": {"kv_cache": _OLD_GPU_DECODE},
    **{p: {"kv_cache": {**_OLD_GPU_DECODE, "batch_size": 1}}
       for p in ("llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b")},
}
OLD_PRESET_SIZES = {"tiny": (4, 64), "reference": (8, 128), "small": (8, 512), "medium": (8, 1024),
                    "gpt2-124m": (8, 1024), "llama-2-7b": (1, 2048), "llama-3-8b": (1, 2048),
                    "llama-3-70b": (1, 2048), "mistral-7b": (1, 2048)}  # (batch_size, seq_len)


def test_preset_sizes_keep_only_the_settings_every_experiment_shares():
    assert {p: (s["batch_size"], s["seq_len"]) for p, s in config.PRESET_SIZES.items()} == OLD_PRESET_SIZES
    assert all(len(s) == 2 for s in config.PRESET_SIZES.values())


# Sizes changed on purpose since: the pipeline's tiny run takes 4 micro-batches of one sequence,
# so that the zero-bubble V schedule (m >= 2p - 1) runs on 2 ranks (issue 29).
RESIZED = {("pipeline_parallel", "tiny"): {"batch_size": 4, "micro_batches": 4, "seq_len": 32,
                                           "timed_steps": 2}}


@pytest.mark.slow
def test_every_resolved_config_is_what_the_old_preset_table_gave(monkeypatch):
    """The old table's entry given as overrides to a resolve that adds no experiment sizes: the
    same config, field by field, for every experiment at every preset."""
    from labkit.techniques import records

    monkeypatch.delenv("LABKIT_PARTICIPANT", raising=False)
    monkeypatch.delenv("LABKIT_TEAM", raising=False)
    for name, exp in records().items():
        if name in EXPERIMENTS_SINCE:
            continue
        for preset in PRESETS:
            old = RESIZED.get((name, preset), OLD_EXPERIMENT_SIZES[preset].get(name, {}))
            assert config.experiment_sizes(name, preset) == old, (name, preset)
            new = resolve(exp.Config, preset, {"device": "cpu"}, experiment=name).params()
            before = resolve(exp.Config, preset, {"device": "cpu", **old}).params()
            assert new == before, (name, preset)


def test_experiment_sizes_come_from_the_module_and_go_under_overrides():
    assert mixed_precision.SIZES["tiny"] == {"batch_size": 2}
    assert resolve(mixed_precision.Config, "tiny", {"device": "cpu"},
                   experiment="mixed_precision").batch_size == 2
    assert resolve(mixed_precision.Config, "tiny", {"device": "cpu"}).batch_size == 4  # no experiment
    assert resolve(mixed_precision.Config, "tiny", {"device": "cpu", "batch_size": 3},
                   experiment="mixed_precision").batch_size == 3
    assert config.experiment_sizes("", "tiny") == {} and config.experiment_sizes("nope", "tiny") == {}
