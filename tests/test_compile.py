"""torch.compile: compiled outputs and gradients equal eager's, no graph breaks, no recompiles
across decode positions, cold-compile rows present. Never asserts speed. One compile per target."""
import pytest
import torch

from conftest import FAST, by

from labkit import hardware
from labkit.config import ConfigError, resolve
from labkit.harness.experiment import run_experiment
from labkit.measure import compiler
from labkit.blocks.model import build_model
from labkit.techniques import compiling
from labkit.blocks.kv_caches import DynamicCache

# 1 layer, width 32: the smallest graphs, so each cold compile takes seconds, not tens
SHAPE = {"num_layers": 1, "hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "ffn_size": 64,
         "vocab_size": 64}
# inductor_cache: a rerun of the tests reuses compiled kernels (the tests never read compile speed)
SIZES = {**FAST, **SHAPE, "batch_size": 2, "seq_len": 8, "prompt_len": 4, "decode_steps": 4,
         "probe_calls": 2, "inductor_cache": True, "device": "cpu"}
pytestmark = [pytest.mark.skipif(hardware.inductor_cpu_problem() is not None,
                                 reason=str(hardware.inductor_cpu_problem())),
              pytest.mark.slow]  # cold torch.compile builds: seconds each


# the block with Inductor's Python wrapper, the decode step with cpp_wrapper (its kernels and
# their caller in one C++ file: the smallest CPU rung's setting): both targets, both wrappers
@pytest.fixture(scope="module", params=[{"target": "block"}, {"target": "decode", "cpp_wrapper": True}],
                ids=["block", "decode-cpp_wrapper"])
def rows(request, tmp_path_factory):
    return run_experiment("compile", preset="tiny", overrides={**SIZES, **request.param},
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
    # the break-even is the formula on the rows' own numbers: compile seconds over the seconds a
    # steady compiled call saves; never (no value, "inf" in the note) when it saves none
    value = {m: by(rows, "default", m)["value"]
             for m in ("compile_s", "probe_eager_ms", "probe_compiled_ms")}
    saved_s = (value["probe_eager_ms"] - value["probe_compiled_ms"]) / 1e3
    even = by(rows, "default", "break_even_steps")
    if saved_s > 0:
        assert even["value"] == pytest.approx(value["compile_s"] / saved_s, rel=1e-9)
    else:
        assert even["value"] is None and "inf" in even["message"]
    for variant in ("eager", "default"):
        flops = by(rows, variant, "flops")
        assert flops["value"] == flops["predicted"]
    # on a CPU, Inductor's once-a-process choice of vector instructions is its own row, before
    # the timed first call: compile_s is the model's compile
    isa = by(rows, "default", "isa_check_s")
    assert isa["value"] > 0 and f"({compiler.inductor_cpu_isa()} here)" in isa["message"]


def test_compile_rows_are_the_formulas_on_given_times():
    """first call 2.5 s, second 0.5 s: 2 s of compiling; eager 3 ms, compiled 1 ms a call:
    2 ms saved, 1000 calls to break even. Not faster: never. A second call slower than the
    first (noise): no compile time, not a negative one."""
    rows = compiling.compile_rows({"first_call_s": 2.5, "second_call_s": 0.5,
                                   "probe_eager_s": 0.003, "probe_compiled_s": 0.001})
    assert rows == pytest.approx({"first_call_ms": 2500.0, "compile_s": 2.0, "probe_eager_ms": 3.0,
                                  "probe_compiled_ms": 1.0, "break_even_steps": 1000.0})
    slower = compiling.compile_rows({"first_call_s": 2.5, "second_call_s": 0.5,
                                     "probe_eager_s": 0.001, "probe_compiled_s": 0.002})
    assert slower["break_even_steps"] == float("inf")
    noisy = compiling.compile_rows({"first_call_s": 0.4, "second_call_s": 0.5,
                                    "probe_eager_s": 0.003, "probe_compiled_s": 0.001})
    assert noisy["compile_s"] == 0.0 and noisy["break_even_steps"] == 0.0


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


def test_cpp_wrapper_reaches_inductor_and_only_mode_default_takes_it(monkeypatch):
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    for variant in ("default", "max-autotune-no-cudagraphs"):
        for wrapper in (False, True):
            cfg = resolve(compiling.Config, "tiny", {"variant": variant, "cpp_wrapper": wrapper},
                          experiment="compile")
            if compiling.skip_reason(cfg) is None:
                compiling.compile_fn(lambda: None, cfg)
    assert seen == [{"options": None}, {"options": {"cpp_wrapper": True}}]
    on_gpu = resolve(compiling.Config, "tiny", {"variant": "reduce-overhead", "cpp_wrapper": True},
                     experiment="compile")
    on_gpu.device = "cuda"
    assert "option of mode default" in compiling.skip_reason(on_gpu)


def test_the_isa_verdict_is_stored_once_all_pass_and_read_only_under_the_same_key(monkeypatch, tmp_path):
    """With no verdict stored, Inductor checks every ISA and the verdict is stored: this CPU's
    ISAs, best first, all passed. A stored verdict of another key (another torch) changes
    nothing; the same key tells Inductor that all passed, and it picks the same ISA."""
    from torch._inductor import config, cpu_vec_isa

    key = compiler._isa_key()
    if key is None:
        pytest.skip("not an x86 CPU: Inductor's ISA list is not made by build checks")
    path = tmp_path / "verdict.json"
    monkeypatch.setattr(compiler, "_isa_verdict_path", lambda: str(path))
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    picked = compiler.inductor_cpu_isa()
    assert config.cpp.vec_isa_ok is None
    if [str(i) for i in cpu_vec_isa.valid_vec_isa_list()] != key["isas"]:
        assert not path.exists()  # an ISA failed its check here: nothing to store
        return
    assert compiler._read_verdict(str(path)) == key

    compiler._write_verdict(str(path), {**key, "torch": "0.0"})
    assert compiler.inductor_cpu_isa() == picked and config.cpp.vec_isa_ok is None
    compiler._write_verdict(str(path), key)
    assert compiler.inductor_cpu_isa() == picked and config.cpp.vec_isa_ok is True
