import gc
import weakref

import pytest
import torch

from conftest import FAST, TINY_DECODE, TINY_TRAIN, measured
from labkit import planner
from labkit.config import ConfigError
from labkit.harness.experiment import lab_plan, run_experiment
from labkit.measure.memory import CPU_ALLOCATOR_OOM, LiveTensorTracker
from labkit.results import load_results, metric_skipped
from labkit.techniques import kv_cache, mixed_precision, records


def by(rows, variant, metric, sweep=None):
    hits = [r for r in rows if r["variant"] == variant and r["metric"] == metric
            and (sweep is None or r["params"]["sweep"] == sweep)]
    assert len(hits) == 1, (variant, metric, hits)
    return hits[0]


@pytest.mark.slow
def test_kv_cache_tokens_identical_and_bytes_measured_equal_the_formula():
    result = run_experiment("kv_cache", preset="tiny", overrides={**TINY_DECODE, "device": "cpu"},
                            progress=False)
    rows = result.rows
    assert [r["variant"] for r in rows][0] == "none"  # the reference runs first
    assert by(rows, "none", "token_agreement")["value"] == 1.0
    assert by(rows, "dynamic", "token_agreement")["value"] == 1.0
    m = result.rows[0]["params"]["model"]
    per_token = 2 * m["num_layers"] * m["num_kv_heads"] * (m["hidden_size"] // m["num_heads"]) * 4
    row = by(rows, "dynamic", "kv_bytes_per_token")
    assert row["value"] == row["predicted"] == per_token
    held = 1 * (4 + 6 - 1)  # batch x (prompt + new - 1): the last token is never fed back
    assert by(rows, "dynamic", "kv_bytes")["value"] == per_token * held
    assert by(rows, "dynamic", "flops")["value"] == by(rows, "dynamic", "flops")["predicted"]
    assert all(r["status"] == "ok" for r in measured(rows))
    assert len(load_results(run_id=result.run_id)) == len(rows)  # stored as returned


@pytest.mark.slow
def test_mixed_precision_bytes_and_precision_rows():
    variants = ["fp16", "bf16", "bf16_weights", "tf32"]
    rows = run_experiment("mixed_precision", preset="tiny", overrides={**TINY_TRAIN, "device": "cpu"},
                          variants=variants, progress=False).rows
    fp32 = by(rows, "fp32", "param_bytes")["value"]
    assert by(rows, "bf16_weights", "param_bytes")["value"] * 2 == fp32  # exactly half
    assert by(rows, "bf16_weights", "param_bytes")["predicted"] * 2 == fp32
    # the master copy: the 16-bit weights' optimizer holds 4 more bytes per parameter
    extra = by(rows, "bf16_weights", "optimizer_bytes")["value"] - by(rows, "fp32", "optimizer_bytes")["value"]
    assert extra == fp32
    tf32 = [r for r in rows if r["variant"] == "tf32"]
    assert len(tf32) == 1 and tf32[0]["status"] == "skipped" and "CPU" in tf32[0]["message"]
    assert by(rows, "fp16", "loss_scale")["value"] == 2.0**16
    assert by(rows, "fp16", "skipped_steps")["value"] == 0
    assert by(rows, "fp32", "loss_delta")["value"] == 0.0
    assert 0 < by(rows, "bf16", "loss_delta")["value"] < 0.05
    # under autocast some activations stay fp32 and the weights' bf16 casts are counted apart
    assert by(rows, "bf16", "activation_bfloat16_bytes")["value"] > 0
    assert by(rows, "bf16", "activation_float32_bytes")["value"] > 0
    assert "stays fp32" in by(rows, "bf16", "activation_bytes")["message"]
    m = rows[0]["params"]["model"]
    from labkit.config import ModelConfig
    matmul_weights = (m["num_layers"] * planner.block_linear_params(ModelConfig(**m))
                      + m["vocab_size"] * m["hidden_size"])
    assert by(rows, "bf16", "saved_weight_copy_bytes")["value"] == 2 * matmul_weights
    assert by(rows, "fp32", "saved_weight_copy_bytes")["value"] == 0
    assert by(rows, "fp32", "flops")["value"] == by(rows, "fp32", "flops")["predicted"]


@pytest.mark.slow
def test_oom_under_the_virtual_budget_is_a_row_memory_is_freed_and_the_sweep_goes_on():
    gc.collect()
    outer = LiveTensorTracker()
    with outer:
        result = run_experiment("mixed_precision", preset="tiny", variants=["fp32"], progress=False,
                                overrides={**TINY_TRAIN, "memory_budget_gib": 0.1, "device": "cpu"},
                                sweep={"batch_size": [1, 512, 2]})
        gc.collect()
    assert outer.current_bytes == 0  # every tensor of every point, the OOM one too, is gone
    statuses = {r["params"]["sweep"]["batch_size"]: r["status"] for r in result.rows}
    assert statuses == {1: "ok", 512: "oom", 2: "ok"}
    oom = [r for r in result.rows if r["status"] == "oom"]
    assert len(oom) == 1 and "virtual memory budget" in oom[0]["message"]
    assert by(result.rows, "fp32", "peak_mem_bytes", {"batch_size": 2})["value"] < 0.1 * 2**30


@pytest.mark.slow
def test_a_cpu_allocation_failure_is_an_oom_row_its_memory_freed_and_the_sweep_goes_on(monkeypatch):
    """torch's CPU allocator raises a RuntimeError, not torch.OutOfMemoryError: still an `oom`."""
    real_build, held = kv_cache.build, []

    def build(cfg):
        if cfg.variant == "dynamic" and cfg.batch_size == 1:
            tensor = torch.ones(2**16)  # what the variant had allocated when the next one failed
            held.append(weakref.ref(tensor))
            raise RuntimeError(f"[enforce fail at alloc_cpu.cpp:127] err == 0. {CPU_ALLOCATOR_OOM}: "
                               "you tried to allocate 800000000000 bytes. Error code 12")
        return real_build(cfg)

    monkeypatch.setattr(kv_cache, "build", build)
    rows = run_experiment("kv_cache", preset="tiny", overrides={**TINY_DECODE, "device": "cpu"},
                          sweep={"batch_size": [1, 2]}, variants=["dynamic"], progress=False).rows
    dynamic = {r["params"]["sweep"]["batch_size"]: r for r in rows if r["variant"] == "dynamic"}
    assert dynamic[1]["status"] == "oom" and CPU_ALLOCATOR_OOM in dynamic[1]["message"]
    assert dynamic[1]["metric"] is None
    assert by(rows, "dynamic", "token_agreement", {"batch_size": 2})["status"] == "ok"
    assert held and held[0]() is None  # freed with the exception's traceback
    assert {r["status"] for r in measured(rows) if r["variant"] == "none"} == {"ok"}


@pytest.mark.slow
def test_a_variant_that_disagrees_with_the_reference_is_an_error_and_is_not_timed(monkeypatch):
    monkeypatch.setitem(mixed_precision.TOLERANCE, "bf16", 0.0)
    rows = run_experiment("mixed_precision", preset="tiny", overrides={**TINY_TRAIN, "device": "cpu"},
                          variants=["bf16"], progress=False).rows
    bf16 = [r for r in rows if r["variant"] == "bf16"]
    assert {r["status"] for r in bf16} == {"error"}
    # the quality delta and what the steps showed (labkit.techniques.mixed_precision), no timing
    assert {r["metric"] for r in bf16} == {"loss", "loss_delta", *mixed_precision.STEP_FIGURES}
    assert "does not match fp32" in bf16[0]["message"]


@pytest.mark.slow
def test_an_exception_is_an_error_row_and_the_other_variants_still_run(monkeypatch):
    real_build = kv_cache.build

    def build(cfg):
        if cfg.variant == "dynamic":
            raise RuntimeError("boom\nsecond line")
        return real_build(cfg)

    monkeypatch.setattr(kv_cache, "build", build)
    rows = run_experiment("kv_cache", preset="tiny", overrides={**TINY_DECODE, "device": "cpu"},
                          sweep={"batch_size": [1, 2]}, progress=False).rows
    errors = [r for r in rows if r["status"] == "error"]
    assert len(errors) == 2 and errors[0]["message"] == "RuntimeError: boom"
    assert len([r for r in rows if r["variant"] == "none" and r["metric"] == "step_ms"]) == 2


def test_bad_input_fails_before_anything_runs(tmp_path):
    with pytest.raises(ConfigError, match="unknown variant 'fp8'"):
        run_experiment("mixed_precision", variants=["fp8"], runs_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="batch_size=0"):
        run_experiment("kv_cache", sweep={"batch_size": [1, 0]}, runs_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="dtype must be float32"):
        run_experiment("mixed_precision", overrides={"dtype": "bf16"}, runs_dir=str(tmp_path))
    assert not list(tmp_path.iterdir())  # nothing stored, nothing measured
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="cannot store results in .*a-file: it is a file"):
        run_experiment("kv_cache", overrides={"device": "cpu"}, runs_dir=str(tmp_path / "a-file"))


@pytest.mark.slow
def test_rows_are_stored_after_every_point_even_when_the_run_is_interrupted(monkeypatch):
    real_build = kv_cache.build
    calls = []

    def build(cfg):
        calls.append(cfg.variant)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the user pressed Stop during the second point
        return real_build(cfg)

    monkeypatch.setattr(kv_cache, "build", build)
    with pytest.raises(KeyboardInterrupt):
        run_experiment("kv_cache", preset="tiny", overrides={**TINY_DECODE, "device": "cpu"},
                       sweep={"batch_size": [1, 2]}, variants=["dynamic"], progress=False)
    frame = load_results(experiment="kv_cache")
    assert set(frame["variant"]) == {"none", "dynamic"}
    assert (frame[~metric_skipped(frame)]["status"] == "ok").all()


@pytest.mark.slow
def test_lab_plan_says_what_will_be_skipped_here():
    plan = {(p["experiment"], p["variant"]): p for p in lab_plan("cpu")}
    assert not plan[("mixed_precision", "tf32")]["runs"]
    assert plan[("kv_cache", "dynamic")]["runs"] and plan[("kv_cache", "dynamic")]["preset"] == "tiny"


@pytest.mark.slow
def test_a_variant_whose_reference_did_not_run_says_it_is_unchecked():
    # a budget between the peaks of no checkpointing (the reference) and full checkpointing
    rows = run_experiment("checkpointing", preset="tiny", variants=["full"], progress=False,
                          overrides={**FAST, "memory_budget_gib": 0.085, "device": "cpu"}).rows
    assert [r["status"] for r in rows if r["variant"] == "none"] == ["oom"]
    step = by(rows, "full", "step_ms")
    assert step["status"] == "ok" and "NOT CHECKED" in step["message"]


def test_every_registered_experiment_has_a_record_with_its_pieces():
    from pathlib import Path

    from labkit.config import RunConfig
    from labkit.techniques import REGISTRY, records

    recs = records()
    assert list(recs) == list(REGISTRY)
    for name, exp in recs.items():
        assert exp.name == name and issubclass(exp.Config, RunConfig)
        assert exp.reference in exp.variants and exp.variants == tuple(exp.module.VARIANTS)
        assert exp.build is exp.module.build and exp.expected is exp.module.expected
        assert exp.cpu_ranks >= (2 if exp.distributed else 1) and (exp.distributed or exp.cpu_ranks == 1)
        assert exp.notebook is None or (Path(__file__).resolve().parents[1] / exp.notebook).is_file()
    assert recs["hybrid"].cpu_ranks == 4 and recs["zero"].cpu_ranks == 2
    assert recs["zero"].notebook == "notebooks/11_zero.ipynb" and not recs["matmul"].distributed
    assert recs["offload"].validate is None and recs["offload"].skip_reason is not None
    assert recs["compile"].module.__name__ == "labkit.techniques.compiling"


def test_record_of_an_unknown_experiment_names_the_valid_ones():
    from labkit.techniques import record

    with pytest.raises(ConfigError, match="unknown experiment 'nope'; valid: mixed_precision, kv_cache"):
        record("nope")


def test_a_module_that_breaks_the_contract_fails_saying_how():
    import types

    from labkit.techniques.record import from_module

    broken = types.ModuleType("labkit.techniques.broken")
    broken.Config, broken.VARIANTS, broken.REFERENCE = kv_cache.Config, ("a", "b"), "a"
    with pytest.raises(ImportError, match=r"'broken' \(labkit.techniques.broken\) lacks build, "
                                          "compare, expected; an experiment module defines"):
        from_module("broken", broken, None)
    broken.build = broken.compare = broken.expected = lambda *a: None
    assert from_module("broken", broken, None).cpu_ranks == 1
    broken.SIZES = {"huge": {"batch_size": 1}}
    with pytest.raises(ImportError, match="SIZES names unknown preset 'huge'; valid: tiny"):
        from_module("broken", broken, None)
    broken.SIZES, broken.REFERENCE = {}, "c"
    with pytest.raises(ImportError, match="REFERENCE 'c' is not one of VARIANTS"):
        from_module("broken", broken, None)


def test_a_function_patched_on_the_module_is_the_one_the_record_holds(monkeypatch):
    from labkit.techniques import record

    def build(cfg):
        raise AssertionError

    monkeypatch.setattr(kv_cache, "build", build)
    assert record("kv_cache").build is build


def test_no_caller_probes_an_experiment_module_for_its_pieces():
    """Only the record (labkit/techniques/record.py) reads an experiment module's optional names."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "labkit"
    probe = re.compile(r"(getattr|hasattr)\(exp\b|\"(DISTRIBUTED|CPU_RANKS|skip_reason|validate|SIZES)\""
                       r"|\bsplit\(\"_\", 1\)\[-1\]")
    found = [f"{p.relative_to(root)}:{i}" for p in root.rglob("*.py") if p.name != "record.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if probe.search(line)]
    assert found == []


def _another(field):
    """A value of `field` other than its default, that its knob allows."""
    meta, default = field.metadata, field.default
    if meta.get("choices"):
        return next(c for c in meta["choices"] if c != default)
    if isinstance(default, bool):
        return not default
    if default is None or isinstance(default, float):
        return (default or 0.0) + 1.0
    return default + 1 if isinstance(default, int) else default + "x"


def _others(field) -> list:
    """Every other choice of a knob that has choices; else one other value."""
    choices = field.metadata.get("choices")
    return [c for c in choices if c != field.default] if choices else [_another(field)]


IGNORING = [name for name, exp in records().items() if exp.reference_ignores is not None]


@pytest.mark.slow
@pytest.mark.parametrize("name", IGNORING)
def test_the_reference_computes_the_same_with_every_knob_it_ignores_changed(name, tmp_path):
    """What `reference_ignores` names, the reference does not read: its check's outputs (losses,
    weights or gradients) are bit for bit the same with every one of those knobs changed (on a
    one-rank gloo group, which DDP's reference needs), and its notes and predictions with each
    one changed (to each of its other choices) that the experiment accepts alone."""
    import dataclasses

    import torch.distributed as dist

    from labkit.config import resolve

    exp = records()[name]
    sizes = {"nproc": 1} if exp.distributed else {"size_mib": 0.01} if name == "memory_access" else {}
    cfg = resolve(exp.Config, "tiny", {**FAST, "device": "cpu", "batch_size": 2, "seq_len": 8,
                                       "num_layers": 2, **sizes}, experiment=name)
    ignored = exp.reference_ignores(cfg)
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    assert ignored and set(ignored) <= set(fields)
    changed = dataclasses.replace(cfg, **{k: _another(fields[k]) for k in ignored})
    assert all(getattr(changed, k) != getattr(cfg, k) for k in ignored)
    dist.init_process_group("gloo", init_method=(tmp_path / "store").as_uri(), rank=0, world_size=1)
    try:
        before = exp.build(cfg)
        torch.testing.assert_close(exp.build(changed).check(), before.check(), rtol=0, atol=0)
        for knob, value in ((k, v) for k in ignored for v in _others(fields[k])):
            one = dataclasses.replace(cfg, **{knob: value})
            try:
                exp.check(one)
            except ConfigError:
                continue  # never run: nothing to predict
            assert exp.build(one).notes == before.notes and exp.expected(one) == exp.expected(cfg), (knob, value)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_reference_is_measured_once_across_points_that_differ_only_in_knobs_it_ignores():
    """The recipe's plain reads no checkpointing: at the second point its rows are the first
    point's (its step time too, which no second measurement would repeat to the bit), saying so,
    and composed is checked against them; a point that changes what plain reads (seq_len)
    measures it again."""
    points = [{"checkpointing": "none"}, {"checkpointing": "full"}, {"checkpointing": "full", "seq_len": 16}]
    rows = run_experiment("recipe", preset="tiny", progress=False, sweep=points,
                          overrides={**TINY_TRAIN, "device": "cpu", "nproc": 1}).rows
    first, second, third = ([r for r in rows if r["variant"] == "plain" and r["params"]["sweep"] == p]
                            for p in points)
    assert [(r["metric"], r["value"]) for r in second] == [(r["metric"], r["value"]) for r in first]
    assert by(rows, "plain", "step_ms", points[2])["value"] != by(rows, "plain", "step_ms", points[0])["value"]
    note = "measured once, at checkpointing=none: plain does not read checkpointing, where this point differs."
    assert all(r["params"]["checkpointing"] == "full" and r["message"].endswith(note) for r in second)
    assert not any(note in r["message"] for r in first + third)
    checked = by(rows, "composed", "loss_rel_diff", points[1])
    assert checked["status"] == "ok" and checked["value"] is not None
