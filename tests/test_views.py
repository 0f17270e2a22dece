"""The comparison, cost and hardware-fit views: pure functions over synthetic stored runs and the
real data/gpus.json + planner. Mechanisms only: traces per run, the cost formula, the fewest GPUs,
the tables' numbers with their units, where the legends go."""
import math

import pandas as pd
import pytest

from labkit import planner, views
from labkit.views import plots as viz
from labkit.config import ConfigError
from labkit.results import RunRecord, load_results

GPU_ENV = {"device": "cuda", "hostname": "colleague-box", "cpu": {"model": "Xeon", "num_cores": 64},
           "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 85e9}]}
CPU_ENV = {"device": "cpu", "hostname": "laptop", "cpu": {"model": "AMD EPYC", "num_cores": 2}, "gpus": []}


def store(folder, env, device, tokens_per_s, run_id):
    """A finished run of two variants (each with a peak and a throughput) in `folder`."""
    rec = RunRecord("kv_cache", env, {"device": device}, folder, run_id=run_id)
    rows = [{"variant": v, "params": {"device": device, "sweep": {}}, "metric": m, "value": x,
             "unit": "", "predicted": None, "status": "ok", "message": "", "rank": 0}
            for v, scale in (("none", 1.0), ("dynamic", 2.0))
            for m, x in (("peak_mem_bytes", 2**20 * scale), ("tokens_per_s", tokens_per_s * scale))]
    rec.add(rows)
    rec.finish()
    return rec.run_id


@pytest.fixture
def runs(tmp_path):
    """Two runs as if a colleague's GPU runs were copied beside ours: one folder, two machines."""
    folder = tmp_path / "copied"
    ids = [store(folder, GPU_ENV, "cuda", 1000.0, "20261129T100000-kv_cache-1-aaaaaa"),
           store(folder, CPU_ENV, "cpu", 50.0, "20261129T110000-kv_cache-2-bbbbbb")]
    return folder, ids


def test_run_table_reads_any_folder_and_names_the_machine(runs):
    folder, ids = runs
    table = views.run_table(folder)
    assert list(table["run_id"]) == ids[::-1]  # newest first
    gpu = table.set_index("run_id").loc[ids[0]]
    assert gpu["machine"] == "NVIDIA H100 80GB HBM3" and gpu["host"] == "colleague-box"
    assert gpu["variants"] == "none, dynamic" and gpu["status"] == "complete"
    assert table.set_index("run_id").loc[ids[1], "machine"] == "CPU AMD EPYC (2 cores)"


def test_overlay_has_one_trace_group_per_chosen_run_on_shared_axes(runs):
    folder, ids = runs
    frame = load_results(folder)
    fig = views.compare_runs(frame, ids)
    groups = {t.legendgroup for t in fig.data}
    assert groups == {"NVIDIA H100 80GB HBM3 · aaaaaa", "CPU AMD EPYC (2 cores) · bbbbbb"}
    for group in groups:  # one bar in the memory panel, one in the throughput panel
        assert sorted(t.xaxis for t in fig.data if t.legendgroup == group) == ["x", "x2"]
    gpu_tput = next(t for t in fig.data if t.legendgroup.endswith("aaaaaa") and t.xaxis == "x2")
    assert list(gpu_tput.x) == ["none", "dynamic"] and list(gpu_tput.y) == [1000.0, 2000.0]
    assert views.latest_runs(frame, "kv_cache", n=1) == [ids[1]]


def test_unknown_or_no_run_names_the_stored_ones(runs):
    frame = load_results(runs[0])
    for bad in (["nope"], []):
        with pytest.raises(ConfigError, match=r"valid: .*aaaaaa"):
            views.compare_runs(frame, bad)


def test_cost_formula_exact_and_cpu_rows_never_priced_by_default(runs):
    folder, ids = runs
    table = views.cost_table(load_results(folder), price_per_gpu_hour=2.0, num_gpus=4)
    gpu = table[(table["run_id"] == ids[0]) & (table["variant"] == "none")].iloc[0]
    assert gpu["cost_per_million_tokens"] == pytest.approx(2.0 * 4 / 3600 / 1000.0 * 1e6, rel=1e-12)
    assert "x 4 / 3600 s" in gpu["note"]
    cpu = table[table["run_id"] == ids[1]]
    assert len(cpu) == 2 and cpu["cost_per_million_tokens"].isna().all()
    assert cpu["note"].str.startswith("CPU run").all()
    priced = views.cost_table(load_results(folder), cpu_price_per_hour=0.36)
    row = priced[(priced["run_id"] == ids[1]) & (priced["variant"] == "dynamic")].iloc[0]
    assert row["cost_per_million_tokens"] == pytest.approx(0.36 / 3600 / 100.0 * 1e6)
    assert priced[priced["run_id"] == ids[0]]["cost_per_million_tokens"].isna().all()  # no GPU price


@pytest.mark.parametrize("kwargs", [{"price_per_gpu_hour": -1.0}, {"price_per_gpu_hour": math.inf},
                                    {"cpu_price_per_hour": -0.5}, {"num_gpus": 0}])
def test_bad_prices_raise(runs, kwargs):
    with pytest.raises(ConfigError, match="must be"):
        views.cost_table(load_results(runs[0]), **kwargs)


def test_no_runs_yet_gives_empty_tables(tmp_path):
    frame = load_results(tmp_path / "empty")
    assert views.run_table(tmp_path / "empty").empty and views.latest_runs(frame) == []
    assert views.cost_table(frame, 2.0).empty


def test_fit_table_picks_the_fewest_gpus_the_planner_allows():
    settings = dict(model="llama-2-7b", precision="bf16_pure", zero_stage=3, checkpointing="full")
    table = views.fit_table(**settings).set_index("gpu")
    per_gpu = {n: planner.plan_report(**settings, gpus=n)["per_gpu"]["total_bytes"] for n in views.GPU_COUNTS}
    for name in ("GeForce RTX 4090", "H100 SXM5 80GB", "A100 SXM4 40GB"):
        row, memory = table.loc[name], table.loc[name, "memory_gib"] * 2**30
        n = row["num_gpus"]
        assert per_gpu[n] <= memory and all(per_gpu[k] > memory for k in views.GPU_COUNTS if k < n)
        assert row["predicted_gib_per_gpu"] == round(per_gpu[n] / 2**30, 2)
        assert row["headroom_gib"] == round((memory - per_gpu[n]) / 2**30, 2)
    assert table.loc["GeForce RTX 4090", "num_gpus"] > 1  # 7B in pure bf16 needs more than one 24 GB
    assert table.loc["H100 SXM5 80GB", "num_gpus"] == 1  # and fits on one 80 GB


def test_fit_table_respects_tp_and_reports_no_fit():
    tp = views.fit_table("llama-2-7b", tp=2, zero_stage=0)
    assert (tp["num_gpus"].dropna() % 2 == 0).all()
    big = views.fit_table("llama-3-70b", precision="fp32", zero_stage=0, gpu_counts=(1, 2)).set_index("gpu")
    assert not big.loc["T4", "fits"] and "does not fit on 2" in big.loc["T4", "note"]
    fig = views.fit_figure(big.reset_index())
    assert len(fig.data[0].x) == len(big) and "no fit" in fig.data[0].text


def test_bad_fit_inputs_name_the_valid_choices():
    with pytest.raises(ConfigError, match="valid: .*llama-2-7b"):
        views.fit_table("llama-9")
    with pytest.raises(ConfigError, match="valid"):
        views.fit_table("llama-2-7b", precision="fp8")


def test_panels_build_and_show_a_message_without_runs(tmp_path, runs):
    pytest.importorskip("ipywidgets")
    empty = views.comparison_panel(tmp_path / "none")
    assert "no runs stored yet" in str(empty.children[1].outputs)
    full = views.comparison_panel(runs[0])
    assert "application/vnd.plotly.v1+json" in full.children[1].outputs[0]["data"]
    cost = views.cost_panel(load_results(runs[0]))
    assert "CPU run" in cost.children[1].outputs[0]["data"]["text/plain"]
    fit = views.fit_panel()
    assert len(fit.children[1].outputs) == 2


# ---- readable tables and legends off the data (labkit.views.plots) ------------------------------------

def _measured_frame():
    """Two variants, bytes and a throughput, each with a prediction: what a run stores."""
    rows = [{"run_id": "r", "experiment": "kv_cache", "variant": v, "params": {}, "metric": m,
             "value": x * k, "unit": "", "predicted": x, "status": "ok", "message": "", "rank": 0,
             "env": {}} for v, k in (("none", 1.0), ("dynamic", 1.5))
            for m, x in (("peak_mem_bytes", 170 * 2**20), ("tokens_per_s", 60.02888))]
    return pd.DataFrame(rows)


def test_tables_shown_to_people_carry_units_and_the_raw_numbers_stay():
    frame = _measured_frame()
    table = viz.metric_table(frame)
    shown = viz.readable(table)
    assert shown.loc["peak_mem_bytes", "dynamic"] == "255 MiB"
    assert shown.loc["tokens_per_s", "none"] == "60.03 tokens/s"
    assert table.loc["tokens_per_s", "none"] == pytest.approx(60.02888)  # the caller's frame
    predicted = viz.readable(viz.predicted_table(frame))
    assert list(predicted["predicted"]) == ["170 MiB", "60.03 tokens/s"] * 2
    assert list(predicted["measured_over_predicted"])[-1] == "1.5x" and "unit" not in predicted
    for text in (shown.to_string(), shown.to_html(), predicted.to_string()):
        assert "e+0" not in text and "60.02888" not in text


def test_cost_and_fit_tables_read_in_their_columns_units(runs):
    cost = viz.readable(views.cost_table(load_results(runs[0]), price_per_gpu_hour=2.0))
    assert set(cost["measured_tokens_per_s"]) == {"1,000 tokens/s", "2,000 tokens/s", "50 tokens/s",
                                                  "100 tokens/s"}
    ref = viz.readable(views.selfcheck_table(), by_metric=("h200",))
    copy = next(c["h200"] for c in views.selfcheck_table().to_dict("records")
                if c["metric"].startswith("device-to-device copy"))
    assert copy > 1000 and f"{round(copy):,}" in set(ref["h200"])  # GB/s, no exponent


def test_comparison_figures_put_the_legend_above_the_plot_area():
    frame = _measured_frame()
    figures = [viz.variant_comparison(frame), viz.rank_comparison(frame, metrics=("peak_mem_bytes",)),
               views.compare_runs(frame, ["r"]), views.fit_figure(views.fit_table())]
    for fig in figures:
        legend = fig.layout.legend
        # anchored to the figure, so plotly grows the top margin to fit the legend's rows
        assert (legend.orientation, legend.yref, legend.yanchor) == ("h", "container", "top")
        assert legend.y < fig.layout.title.y and not fig.layout.annotations  # no subplot titles under it
    bars = figures[0].data
    assert [t.name for t in bars].count("predicted") == 2
    assert sum(bool(t.showlegend is not False) for t in bars if t.name == "predicted") == 1
    assert bars[0].hovertext == ("170 MiB", "255 MiB")


def test_one_machine_identity_read_from_the_fingerprint():
    h100 = "NVIDIA H100 80GB HBM3"
    assert views.device_identity(GPU_ENV) == views.device_identity(GPU_ENV, "cuda") == ("cuda:0", h100)
    assert views.device_identity(GPU_ENV, "cpu") == ("cpu", "Xeon")  # a CPU run on a GPU host
    assert views.device_identity(GPU_ENV, "cuda:3") == ("cuda:3", None)  # not in the fingerprint
    assert views.machine_name(GPU_ENV, "cuda:3") == "GPU" and views.machine_name(None) == "CPU ? (? cores)"
    assert views.machine_name(GPU_ENV, "cpu") == "CPU Xeon (64 cores)"
    assert views.machine_key(GPU_ENV) == ("colleague-box", "cuda", None, (h100,))
    from labkit.study.exercises import core
    assert core.machine is views.machine_key  # the stored-run key of the exercises
