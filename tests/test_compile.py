"""torch.compile: compiled outputs and gradients equal eager's, no graph breaks, no recompiles
across decode positions, cold-compile rows present. Never asserts speed. One compile per target."""
import pytest
import torch

from conftest import FAST, by

from labkit import hardware
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.blocks.model import build_model
from labkit.techniques import compiling
from labkit.blocks.kv_caches import DynamicCache

# 1 layer, width 32: the smallest graphs, so each cold compile takes seconds, not tens
SHAPE = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "ffn_size": 64,
         "vocab_size": 64}
# inductor_cache: a rerun of the tests reuses compiled kernels (the tests never read compile speed)
SIZES = {**FAST, **SHAPE, "batch_size": 2, "seq_len": 8, "prompt_len": 4, "decode_steps": 4,
         "probe_calls": 2, "inductor_cache": True, "device": "cpu"}
pytestmark = pytest.mark.skipif(hardware.inductor_cpu_problem() is not None,
                                reason=str(hardware.inductor_cpu_problem()))


@pytest.fixture(scope="module", params=["block", "decode"])
def rows(request, tmp_path_factory):
    return run_experiment("compile", preset="tiny", overrides={**SIZES, "target": request.param},
                          progress=False, runs_dir=str(tmp_path_factory.mktemp("runs"))).rows


def test_compiled_matches_eager_with_one_graph_no_breaks_no_recompiles(rows):
    assert {r["status"] for r in rows if r["variant"] in ("eager", "default")} == {"ok"}
    assert by(rows, "eager", "max_rel_diff")["value"] == 0.0
    assert by(rows, "default", "max_rel_diff")["value"] <= compiling.TOLERANCE["float32"]
    assert by(rows, "default", "num_graphs")["value"] == 1
    assert by(rows, "default", "num_graph_breaks")["value"] == 0
    assert by(rows, "default", "num_recompiles")["value"] == 0  # decode: over 4 positions


def test_cold_compile_rows_exist_and_flops_are_eagers(rows):
    for metric in ("first_call_ms", "compile_s", "probe_eager_ms", "probe_compiled_ms", "step_ms"):
        assert by(rows, "default", metric)["value"] > 0
    even = by(rows, "default", "break_even_steps")
    assert even["value"] is None and "inf" in even["message"] or even["value"] > 0
    for variant in ("eager", "default"):
        flops = by(rows, variant, "flops")
        assert flops["value"] == flops["predicted"]


def test_gpu_only_modes_are_skipped_on_the_cpu_with_the_reason(rows):
    for variant in compiling.GPU_ONLY:
        (row,) = [r for r in rows if r["variant"] == variant]
        assert row["status"] == "skipped" and "GPU" in row["message"]


def test_positional_cache_decodes_like_a_growing_cache():
    """The fixed-shape cache (written at a position tensor, read whole under the mask) gives the
    logits of a cache that grows by concatenation."""
    cfg = resolve(compiling.Config, "tiny", {**SIZES, "target": "decode"}, experiment="compile")
    model = build_model(cfg.model).eval()
    text = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    m = cfg.model
    fixed = compiling.PositionalCache(num_layers=1, batch=2, kv_heads=m.num_kv_heads,
                                      head_dim=m.head_dim, max_len=8, dtype=torch.float32, device="cpu")
    grow = DynamicCache(1)
    with torch.inference_mode():
        for i in range(8):
            fixed.pos = torch.tensor([i])
            a = model(text[:, i:i + 1], start_pos=fixed.pos.expand(2), cache=fixed)
            b = model(text[:, i:i + 1], start_pos=i, cache=grow)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bad_settings_name_the_valid_choices():
    with pytest.raises(ConfigError, match="valid: block, decode"):
        resolve(compiling.Config, "tiny", {"target": "graph"}, experiment="compile")
    with pytest.raises(ConfigError, match="cannot hold"):
        cfg = resolve(compiling.Config, "tiny", {**SIZES, "target": "decode", "max_cache_len": 5},
                      experiment="compile")
        compiling.validate(cfg)
