import os

import pytest
import torch

from labkit import config
from labkit.config import (DTYPE_ALIASES, MODELS, PRESETS, ConfigError, RunConfig, expand_sweep,
                           parse_assignments, resolve, usable_threads)
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


def test_dtype_aliases_are_canonical():
    assert set(DTYPE_ALIASES.values()) == {"float32", "bfloat16", "float16"}
