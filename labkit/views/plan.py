"""The planner's answer as people read it: the `labkit plan` table, DataFrames, the notebook's
stacked bars and widget panel, and the worked example. Pure presentation over
`labkit.planner.plan_report`: no technique code, nothing measured here. plotly and ipywidgets
are imported where they are used, so the CLI runs with the core packages only."""
from __future__ import annotations

import dataclasses
from typing import Any

import pandas as pd

from labkit import planner
from labkit.results import format_value

GIB = 2**30
TERMS = ("param", "grad", "optimizer", "activation", "overhead")
LABELS = {"param": "parameters", "grad": "gradients", "optimizer": "optimizer states",
          "activation": "activations", "overhead": "overhead"}
COLORS = {"param": "#e76f51", "grad": "#f4a261", "optimizer": "#8e7dbe", "activation": "#457b9d",
          "overhead": "#264653"}


def gib(n: float) -> float:
    return n / GIB


# --- The command line's table --------------------------------------------------------------------

def format_plan(report: dict) -> str:
    """The human answer of `labkit plan`: a header, the terms with their formulas, fits or not,
    the KV cache for serving, and the recommendation."""
    lines = [_header(report), ""]
    lines += _term_lines(report)
    lines += ["", _fits_line(report)]
    if report["inference"]:
        lines.append(_serving_line(report))
    if report.get("moe"):
        lines += _moe_lines(report)
    if report.get("finetune"):
        lines += _finetune_lines(report)
    else:
        lines.append(_recommendation_line(report["recommendation"]))
    return "\n".join(lines)


BASE_WORDS = {"qlora": " (NF4: 4-bit codes + int8 scalers per 64 + double-quantized factors)",
              "lora_int8": " (int8: 1 byte a weight + a 16-bit scale per output channel)",
              "lora_int4": " (int4: 4-bit codes + a 16-bit scale and zero point per 64 inputs)"}


def _finetune_lines(r: dict) -> list[str]:
    """Fine-tuning: what is trained and stored, and per method the longest sequence and the
    largest micro-batch that fit the GPU (`finetune_frontier`)."""
    ft, g = r["finetune"], r["per_gpu"]
    share = r["trainable_params"] / r["num_params"]
    out = [f"fine-tuning {ft['method']}: {r['trainable_params']:,} trainable parameters "
           f"({share:.3%} of the base); LoRA r={ft['lora_rank']} alpha={ft['lora_alpha']:g} on "
           f"{','.join(ft['lora_targets'])} ({', '.join(ft['lora_modules']) or 'every weight'}); "
           f"compute {ft['compute_dtype']}, adapters {ft['adapter_dtype']}",
           f"block linear weights as stored: {gib(g['linear_weight_bytes']):.2f} GiB"
           + BASE_WORDS.get(ft["method"], ""),
           f"what fits {gib(r['gpu_mem_bytes']):.2f} GiB (longest sequence at micro-batch 1; "
           f"largest micro-batch at {r['inputs']['seq_len']} tokens):"]
    for row in r["finetune_frontier"]:
        out.append(f"  {row['method']:<9} checkpointing {row['checkpointing']:<5} "
                   f"max seq {row['max_seq_len']:>7,}  max micro-batch {row['max_micro_batch']:>6,}")
    return out


def _moe_lines(r: dict) -> list[str]:
    """A mixture of experts: the parameters one token uses, and one expert-parallel rank's share."""
    moe, rank = r["moe"], r["moe"]["per_rank"]
    return [f"mixture of experts: {moe['num_experts']} experts, top-{moe['experts_per_token']}: "
            f"{moe['active_params']:,} active parameters per token of {r['num_params']:,} "
            f"({moe['active_params'] / r['num_params']:.1%}); experts {moe['expert_params']:,}",
            f"expert parallel ep {rank['ep']}: {rank['params']:,} parameters per rank "
            f"({rank['expert_params']:,} of experts, {rank['replicated_params']:,} replicated); "
            f"weights {gib(rank['param_bytes']):.2f} GiB, model states {gib(rank['model_states_bytes']):.2f} "
            f"GiB per rank ({r['inputs']['precision']}, {r['inputs']['optimizer']}, no ZeRO)"]


def _header(r: dict) -> str:
    i = r["inputs"]
    model = r["model"] or "a bare parameter count (model states only)"
    return (f"{model}: {r['num_params'] / 1e9:.3g} B parameters | {i['precision']}, "
            f"{i['optimizer']} ({i['optimizer_impl']}), ZeRO {i['zero_stage']}, "
            f"checkpointing {i['checkpointing']} | tp {i['tp']} x pp {i['pp']} x dp {i['dp']} = "
            f"{i['gpus']} GPU(s) of {i['gpu_mem_gib']:g} GiB | micro-batch {i['batch_size']} x "
            f"{i['seq_len']} tokens, {i['accumulation_steps']} accumulation step(s), effective "
            f"batch {i['effective_batch']}")


def _term_lines(r: dict) -> list[str]:
    held, per_gpu = r["held_at_peak"], r["per_gpu"]
    out = [f"{'per GPU':<20}{'GiB':>9}  {'at peak':<8} formula"]
    for term in TERMS:
        mark = "yes" if term in held else "freed"
        out.append(f"{LABELS[term]:<20}{gib(per_gpu[term + '_bytes']):>9.2f}  {mark:<8} "
                   f"{r['formulas'].get(term, '')}")
    if r["model"]:
        out.append(f"{'  one layer':<20}{gib(per_gpu['activation_bytes_per_layer']):>9.3f}")
    other = max((k for k in r["phase_bytes"] if k != r["peak_phase"]), key=r["phase_bytes"].get)
    out.append(f"{'total (peak)':<20}{gib(per_gpu['total_bytes']):>9.2f}  {'':<8} peak at "
               f"{_phase(r['peak_phase'])}; at {_phase(other)}: "
               f"{gib(r['phase_bytes'][other]):.2f} GiB" + _stage_note(r))
    return out


def _phase(name: str) -> str:
    return {"backward": "the backward", "step": "the optimizer step",
            "forward": "the forward's first all-gathers", "reduce": "the last reduce-scatter"}[name]


def _stage_note(r: dict) -> str:
    return f" ({r['stage']} pipeline stage, the fuller one)" if r["stage"] != "all" else ""


def _fits_line(r: dict) -> str:
    room = gib(r["headroom_bytes"])
    verdict = f"fits, {room:.2f} GiB to spare" if r["fits"] else f"does NOT fit: {-room:.2f} GiB over"
    return (f"GPU memory {gib(r['gpu_mem_bytes']):.2f} GiB: {verdict} (the CUDA context and "
            "allocator fragmentation are not counted)")


def _serving_line(r: dict) -> str:
    s, i = r["inference"], r["inputs"]
    return (f"serving {i['batch_size']} x {i['seq_len']} tokens: KV cache "
            f"{gib(s['kv_cache_bytes']):.2f} GiB per GPU ({r['kv_cache_bytes_per_token']:,} bytes "
            f"per token, all layers) + weights {gib(s['param_bytes']):.2f} GiB = "
            f"{gib(s['total_bytes']):.2f} GiB: {'fits' if s['fits'] else 'does NOT fit'}")


def _recommendation_line(rec: dict) -> str:
    head = "recommended" if rec["fits"] else "no plan fits"
    return (f"{head}: {rec['precision']}, checkpointing {rec['checkpointing']}, ZeRO "
            f"{rec['zero_stage']}, micro-batch {rec['micro_batch']} x {rec['accumulation_steps']} "
            f"accumulation step(s) for an effective batch of {rec['effective_batch']}: "
            f"{gib(rec['total_bytes']):.2f} GiB per GPU. {rec['reason']}")


# --- Frames and figures ---------------------------------------------------------------------------

def plan_frame(report: dict) -> pd.DataFrame:
    """One row per term: GiB, whether the peak holds it, and its formula."""
    rows = [{"term": LABELS[t], "GiB": gib(report["per_gpu"][f"{t}_bytes"]),
             "at peak": t in report["held_at_peak"], "formula": report["formulas"].get(t, "")}
            for t in TERMS]
    rows.append({"term": "total (predicted peak)", "GiB": gib(report["per_gpu"]["total_bytes"]),
                 "at peak": True, "formula": f"peak at {_phase(report['peak_phase'])}"})
    return pd.DataFrame(rows)


def stacked_terms(reports: dict[str, dict], *, title: str = "") -> Any:
    """A stacked bar per plan of the per-GPU terms held at its peak (GiB), with each plan's GPU
    memory as a dashed line."""
    import plotly.graph_objects as go

    from labkit.views import plots as viz

    names = list(reports)
    fig = go.Figure()
    for term in TERMS:
        values = [gib(r["per_gpu"][f"{term}_bytes"]) if term in r["held_at_peak"] else 0.0
                  for r in reports.values()]
        fig.add_bar(x=names, y=values, name=LABELS[term], marker_color=COLORS[term])
    fig.add_scatter(x=names, y=[gib(r["gpu_mem_bytes"]) for r in reports.values()],
                    mode="lines+markers", name="GPU memory", line={"dash": "dash", "color": "black"})
    fig.update_layout(barmode="stack", title=title, yaxis_title="GiB per GPU (predicted peak)")
    return viz.legend_above(fig, 480)


def summary_row(label: str, report: dict) -> dict:
    """One line of a comparison table: the knobs, each term held at the peak, total, fits."""
    i, g = report["inputs"], report["per_gpu"]
    row = {"step": label, "precision": i["precision"], "checkpointing": i["checkpointing"],
           "ZeRO": i["zero_stage"], "micro-batch": i["batch_size"],
           "accumulation": i["accumulation_steps"]}
    row.update({f"{LABELS[t]} GiB": round(gib(g[f'{t}_bytes']), 2) for t in TERMS})
    row.update({"peak at": report["peak_phase"],
                "held at peak": " + ".join(LABELS[t] for t in TERMS if t in report["held_at_peak"]),
                "total GiB": round(gib(g["total_bytes"]), 2), "fits": report["fits"]})
    return row


# --- The worked example ---------------------------------------------------------------------------

# Each step changes one thing from the one before; the planner's recommendation comes last.
WORKED_STEPS = (
    ("fp32", {"precision": "fp32"}),
    ("bf16 weights, fp32 master copies", {"precision": "bf16_weights"}),
    ("+ full checkpointing", {"checkpointing": "full"}),
    ("+ ZeRO-1 (optimizer states)", {"zero_stage": 1}),
    ("+ ZeRO-2 (+ gradients)", {"zero_stage": 2}),
    ("+ ZeRO-3 (+ parameters)", {"zero_stage": 3}),
    ("pure bf16 (8 B/param)", {"precision": "bf16_pure"}),
    ("smaller micro-batch", {"batch_size": 6}),
    ("smaller micro-batch", {"batch_size": 4}),
)


def worked_example(*, model: str = "llama-2-7b", gpus: int = 4, gpu_mem_gib: float = 24.0,
                   seq_len: int = 4096, effective_batch: int = 32) -> dict[str, dict]:
    """The study guide's walk: one big model on a few small GPUs, one change per step, every
    number from the planner, the planner's recommendation last. A smaller micro-batch keeps the
    effective batch by accumulating when it divides it, else trains a smaller effective batch."""
    settings = {"model": model, "gpus": gpus, "gpu_mem_gib": gpu_mem_gib, "seq_len": seq_len,
                "batch_size": max(1, effective_batch // gpus)}
    out = {}
    for label, change in WORKED_STEPS:
        settings.update(change)
        report = planner.plan_report(**settings, effective_batch=_effective(settings, effective_batch))
        out[_label(label, report)] = report
    rec = report["recommendation"]
    best = {**settings, "precision": rec["precision"], "checkpointing": rec["checkpointing"],
            "zero_stage": rec["zero_stage"], "batch_size": rec["micro_batch"]}
    out["recommended"] = planner.plan_report(**best, effective_batch=rec["effective_batch"])
    return out


def _effective(settings: dict, target: int) -> int:
    per_step = settings["batch_size"] * settings["gpus"]
    return target if target % per_step == 0 else per_step


def _label(label: str, report: dict) -> str:
    if label != "smaller micro-batch":
        return label
    i = report["inputs"]
    accumulate = f" x {i['accumulation_steps']} accumulation" if i["accumulation_steps"] > 1 else ""
    return f"micro-batch {i['batch_size']}{accumulate} (effective {i['effective_batch']})"


def worked_table(reports: dict[str, dict]) -> pd.DataFrame:
    return pd.DataFrame([summary_row(label, r) for label, r in reports.items()])


# --- Checking the planner against a measurement ---------------------------------------------------

def measured_vs_predicted(frame: pd.DataFrame) -> pd.DataFrame:
    """For the fp32 AdamW reference rows of a mixed_precision run: the measured peak of one
    training step and the activations its forward held, beside `training_memory`'s prediction
    for the same config and device (which the run already carries in `predicted`)."""
    rows = frame[(frame["status"] == "ok") & (frame["variant"] == "fp32")
                 & frame["metric"].isin(["peak_mem_bytes", "activation_bytes"])]
    params = rows["params"]
    return pd.DataFrame({
        "device": params.map(lambda p: p["device"]), "batch_size": params.map(lambda p: p["batch_size"]),
        "seq_len": params.map(lambda p: p["seq_len"]), "metric": rows["metric"],
        "measured": rows["value"], "predicted": rows["predicted"],
        "ratio": rows["predicted"] / rows["value"]}).reset_index(drop=True)


# --- A notebook's predictions for its own config ("what to look for") ------------------------------

# The settings a prediction line names (those the config has), besides the swept ones.
CONFIG_FIELDS = ("batch_size", "seq_len", "micro_batches", "prompt_len", "new_tokens", "dtype", "nproc")


def predicted_lines(name: str, metrics: tuple[str, ...], *, preset: str | None = None,
                    overrides: dict[str, Any] | None = None, sweep: dict[str, list] | None = None,
                    variants: list[str] | None = None,
                    fields: tuple[str, ...] = CONFIG_FIELDS) -> str:
    """Markdown: `expected(cfg)` of experiment `name` for `metrics`, for the configs a run with
    these settings resolves (the reference and `variants`, all by default, at every sweep point),
    one block per point naming its preset, device, swept values and the config's `fields` (run
    or model fields). Variants that cannot run here are named, not predicted. Nothing is built
    or measured; bad settings raise ConfigError as the run does."""
    from labkit.harness.experiment import choose_variants, plan_points
    from labkit.techniques import record

    rec = record(name)
    chosen = choose_variants(rec, variants)
    blocks = []
    for point, cfg in plan_points(name, preset, overrides, sweep):
        configs = {v: dataclasses.replace(cfg, variant=v) for v in chosen}
        skipped = [v for v, c in configs.items() if rec.why_skipped(c)]
        predicted = {v: rec.expected(c) for v, c in configs.items() if v not in skipped}
        lines = [_prediction_line(m, predicted) for m in metrics]
        if skipped:
            lines.append(f"- not predicted, cannot run here: {', '.join(skipped)}")
        blocks.append("\n".join([_config_header(point, cfg, fields), *lines]))
    return "\n\n".join(blocks)


def _config_header(point: dict[str, Any], cfg: Any, fields: tuple[str, ...]) -> str:
    params = cfg.params()
    values = {**(params.pop("model") or {}), **params}  # run fields win over the model's of one name
    shown = [f for f in fields if f in values and f not in point and (f != "seq_len" or cfg.uses_seq_len)]
    at = f" at {', '.join(f'{k}={v}' for k, v in point.items())}" if point else ""
    settings = ", ".join([f"preset {cfg.preset}"] + [f"{f} {values[f]}" for f in shown]
                         + [f"on {cfg.device}"])
    return f"**Predicted by `expected()`{at}** for this config ({settings}):"


def _prediction_line(metric: str, predicted: dict[str, dict[str, float]]) -> str:
    values = {v: out[metric] for v, out in predicted.items() if out.get(metric) is not None}
    if not values:
        return f"- `{metric}`: not predicted for this config"
    shown = {v: format_value(metric, x) for v, x in values.items()}
    if len(predicted) > 1 and len(values) == len(predicted) and len(set(shown.values())) == 1:
        return f"- `{metric}`: {next(iter(shown.values()))} (every variant)"
    return f"- `{metric}`: " + " · ".join(f"{v} {text}" for v, text in shown.items())


def show_predicted(name: str, metrics: tuple[str, ...], **settings: Any) -> Any:
    """`predicted_lines` as a Markdown output, for a notebook cell."""
    from IPython.display import Markdown

    return Markdown(predicted_lines(name, metrics, **settings))


# --- The widget panel -----------------------------------------------------------------------------

def build_plan_panel(**defaults: Any) -> Any:
    """Planner inputs as widgets, the per-GPU stacked bar (this plan beside the recommended one)
    and the table; redrawn on every change. Bad input shows its one-line error in the panel."""
    import ipywidgets as W

    from labkit.views import plots as viz

    controls = _plan_controls(W, defaults)
    output = W.Output()

    def redraw(_=None) -> None:
        viz.show_items(output, plan_items({k: w.value for k, w in controls.items()}))

    for widget in controls.values():
        widget.observe(redraw, names="value")
    redraw()
    grid = W.GridBox(list(controls.values()), layout=W.Layout(grid_template_columns="repeat(3, 1fr)"))
    return W.VBox([grid, output])


def _plan_controls(W, defaults: dict) -> dict:
    """One widget per input of `plan_report`, filled with `defaults`."""
    d = {"model": "llama-2-7b", "batch_size": 1, "seq_len": 2048, "precision": "bf16_weights",
         "optimizer": "adamw", "zero_stage": 0, "tp": 1, "pp": 1, "gpus": 4, "gpu_mem_gib": 24.0,
         "checkpointing": "none", "effective_batch": 32, **defaults}
    label = {"style": {"description_width": "initial"}}
    choices = {"model": planner.PRESETS, "precision": planner.PRECISIONS,
               "optimizer": planner.OPTIMIZERS, "checkpointing": planner.CHECKPOINTING,
               "zero_stage": planner.ZERO_STAGES}
    out = {k: W.Dropdown(options=list(v), value=d[k], description=k, **label) for k, v in choices.items()}
    for name in ("batch_size", "seq_len", "effective_batch", "tp", "pp", "gpus"):
        out[name] = W.BoundedIntText(value=d[name], min=1, max=10**6, description=name, **label)
    out["gpu_mem_gib"] = W.BoundedFloatText(value=d["gpu_mem_gib"], min=0.1, max=1e5,
                                            description="gpu_mem_gib", **label)
    return out


def plan_items(values: dict) -> list:
    """What the panel shows for these inputs: the stacked bar of this plan beside the
    recommended one, the terms' table, fits or not and the recommendation; or the one-line
    error."""
    try:
        report = planner.plan_report(**values)
        rec = report["recommendation"]
        best = planner.plan_report(**{**values, "precision": rec["precision"],
                                      "checkpointing": rec["checkpointing"],
                                      "zero_stage": rec["zero_stage"], "batch_size": rec["micro_batch"]})
    except planner.ConfigError as e:  # bad input: say it in the panel, as the CLI would
        return [f"error: {e}"]
    from labkit.views import plots as viz

    return [stacked_terms({"your plan": report, "recommended": best}), viz.readable(plan_frame(report)),
            _fits_line(report) + "\n" + _recommendation_line(rec)]
