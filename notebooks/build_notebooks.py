"""Writes the notebooks in notebooks/ from the templates here and their prose in notebooks/text/
(one Markdown file per notebook, sections named by `<!-- name -->` lines; `_experiment.md` holds
the experiment template's own). Ranks and notebook paths come from each experiment's record
(`labkit.techniques.record`). Edit the prose or a template, then run
`python notebooks/build_notebooks.py` (outputs are never committed); tests/test_notebooks.py fails
when a committed notebook differs from what this writes."""
import re
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from labkit.techniques import record, records

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "text"
KERNEL = {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
          "language_info": {"name": "python"}}
SECTION = re.compile(r"^<!-- (\w+) -->$", re.MULTILINE)


def read_text(stem: str) -> dict[str, str]:
    """The named sections of notebooks/text/STEM.md, each without its surrounding blank lines."""
    parts = SECTION.split((TEXT / f"{stem}.md").read_text())
    if parts[0].strip():
        raise ValueError(f"{stem}.md: text before its first `<!-- name -->` line")
    return {name: body.strip("\n") for name, body in zip(parts[1::2], parts[2::2])}


def markdown(text: dict[str, str], *names: str) -> list:
    return [new_markdown_cell(text[n]) for n in names]


def look_for(text: dict[str, str], call: str | None = None) -> list:
    """The closing cells: the prose, then (for an experiment) its predictions for this config,
    rendered at run time by `plan_view.show_predicted` (`call`: its arguments)."""
    cells = [new_markdown_cell(f"## What to look for\n\n{text['look_for']}")]
    if call:
        cells.append(new_code_cell(f"from labkit.views import plan as plan_view\n\nplan_view.show_predicted({call})"))
    return cells


def predicted_call(name: str, metrics: tuple[str, ...], settings: str, sweep: str,
                   fields: tuple[str, ...] | None = None) -> str:
    """`show_predicted`'s arguments: the run's own settings, sweep and variants (`fields`: the
    config fields its header names; None: plan_view's default)."""
    indent = "\n" + " " * len("plan_view.show_predicted(")
    listed = ", ".join(f'"{m}"' for m in metrics) + ("," if len(metrics) == 1 else "")
    field_list = ", ".join(f'"{f}"' for f in fields or ()) + ("," if fields and len(fields) == 1 else "")
    return (f'"{name}", ({listed}), preset=preset,{indent}overrides={settings},{indent}'
            f'sweep={sweep}, variants=None if variants == "all" else variants.split(",")'
            + ("" if fields is None else f",{indent}fields=({field_list})"))


EXPERIMENT_PARAMETERS = '''preset = None  # model shape and sizes: tiny, small, medium, gpt2-124m, ...; None: from the device
device = "auto"  # auto, cpu, cuda or cuda:N
variants = "all"  # comma-separated variants to run beside the reference, or "all"
overrides = {}  # any config field, e.g. {"batch_size": 8, "seq_len": 128}
sweep = {SWEEP}  # config fields and the values to sweep, e.g. {"batch_size": [1, 2, 4]}
interactive = True  # show the widget panel to re-run with other settings
runs_dir = None  # where results are stored (None: $LABKIT_RUNS_DIR or ./runs)'''

NPROC_PARAMETER = "\nnproc = None  # ranks: None is one per visible GPU, else {CPU_RANKS} CPU ranks"
HF_MODEL_PARAMETER = ('\nhf_model = ""  # a Hugging Face folder with config.json: its shape (random weights '
                      'unless it holds safetensors); "": the preset\'s shape')
# Before the run: a Hugging Face folder's shape replaces the preset's (sizes still come from the
# preset and overrides), for every cell below that reads `overrides`.
HF_MODEL_CODE = """from labkit.blocks.hf import model_config

if hf_model:
    overrides = {**overrides, "model": model_config(hf_model)}

"""


def experiment_notebook(name: str, sweep: str = "{}", extra: tuple = (), predicted: tuple[str, ...] = (),
                        fields: tuple[str, ...] | None = None, model: bool = True,
                        parameters: str = "") -> nbformat.NotebookNode:
    """The notebook of experiment `name`: its text's `intro`, the parameters (with `nproc` for a
    multi-process experiment, whose run shows every rank; `hf_model` where it builds a `model`;
    then its own `parameters` lines), the run, its numbers, `extra` cells ((section of its text,
    code) pairs) after them, the H200 overlay, the panel, `look_for` and the `predicted` metrics
    of `expected()` for the notebook's own config (naming `fields`)."""
    rec, tpl = record(name), read_text("_experiment")
    text = read_text(Path(rec.notebook).stem)
    source = EXPERIMENT_PARAMETERS.replace("{SWEEP}", sweep)
    settings = '{**overrides, "device": device}'
    if rec.distributed:
        source += NPROC_PARAMETER.replace("{CPU_RANKS}", str(rec.cpu_ranks))
        settings = '{**overrides, "device": device, "nproc": nproc}'
    source += (HF_MODEL_PARAMETER if model else "") + parameters
    return new_notebook(metadata=KERNEL, cells=[
        *markdown(text, "intro"),
        new_code_cell(source, metadata={"tags": ["parameters"]}),
        *markdown(tpl, "machine"),
        new_code_cell("from labkit import hardware\n\nprint(hardware.describe())"),
        *markdown(tpl, "run"),
        new_code_cell(
            (HF_MODEL_CODE if model else "") +
            "from labkit.harness.experiment import run_experiment\n"
            "from labkit.ui.widgets import build_panel, show_result\n\n"
            f'result = run_experiment("{name}", preset=preset, overrides={settings},\n'
            '                        variants=None if variants == "all" else variants.split(","),\n'
            "                        sweep=sweep, runs_dir=runs_dir, progress=False)\n"
            "frame = result.frame()\n"
            f'show_result(frame, "{name}")'),
        *markdown(tpl, "numbers"),
        new_code_cell("from labkit.views import plots as viz\n\nviz.readable(viz.metric_table(frame))  # numbers with units; "
                      "viz.metric_table(frame) holds them as numbers"),
        *[cell for section, code in extra for cell in (new_markdown_cell(text[section]), new_code_cell(code))],
        *markdown(tpl, "reference"),
        new_code_cell(f'from labkit import views\n\nviews.reference_overlay(frame, "{name}")'),
        *markdown(tpl, "panel"),
        new_code_cell("if interactive:\n"
                      f'    display(build_panel("{name}", preset=preset, device=device,\n'
                      "                        overrides=overrides, runs_dir=runs_dir))"),
        *look_for(text, predicted and predicted_call(name, predicted, settings, "sweep", fields)),
    ])


# --- Each experiment's notebook: default sweep, extra cells, the metrics its predictions show -----

KV_BLOCK_TABLE = '''from labkit.config import resolve
from labkit.techniques import kv_cache

cfg = resolve(kv_cache.Config, preset, {**overrides, "device": device, "batch_size": 4},
              experiment="kv_cache")
viz.block_table_figure(kv_cache.paged_block_table(cfg)).show()'''
KV_INT8 = '''bf16 = run_experiment("kv_cache", preset=preset, variants=["static", "quantized"],
                      overrides={**overrides, "device": device, "kv_dtype": "bfloat16"},
                      runs_dir=runs_dir, progress=False).frame()
viz.readable(viz.metric_table(bf16).loc[["kv_bytes", "kv_bytes_per_token",
                                         "attn_output_rel_error", "token_agreement"]])'''
SPEC_FORMULA = '''import pandas as pd
from labkit.blocks.speculative import expected_tokens_per_step

ks = range(1, 9)
pd.DataFrame({f"alpha = {a}": [expected_tokens_per_step(a, k) for k in ks] for a in (0.5, 0.8, 0.9, 0.95)},
             index=pd.Index(ks, name="num_speculative")).round(2)'''
BATCHING_LATENCY = 'viz.latency_bars(frame, "ttft").show()\nviz.latency_bars(frame, "tpot").show()'
BATCHING_SCHEDULE = '''from labkit.config import resolve
from labkit.techniques import batching

for variant in ("static", "continuous"):
    cfg = resolve(batching.Config, preset, {**overrides, "device": device, "variant": variant},
                  experiment="batching")
    viz.schedule_figure(*batching.schedule_frames(cfg), title=variant).show()'''
BATCHING_TRICKS = '''chunk = 32  # prefill_chunk: positions a long prompt prefills per iteration

cfg = resolve(batching.Config, preset, {**overrides, "device": device, "variant": "continuous"},
              experiment="batching")
tricks = batching.tricks_frame(cfg, prefill_chunk=chunk)
viz.readable(tricks)'''
MATMUL_ROOFLINE = '''from labkit.views import roofline
from labkit.config import resolve_device

dev = hardware.ceilings(resolve_device(device)).device
ceil = roofline.ceilings_for(dev, runs_dir)
display(roofline.ceilings_table(ceil))
roofline.figure_for(dev, runs_dir).show()'''
PROFILE_ONCE = '''from labkit.config import resolve
from labkit.techniques import profiling

cfg = resolve(profiling.Config, preset, {**overrides, "device": device},
              experiment="profiling")
prof = profiling.profile_once(cfg)
print("\\n".join(prof.findings()))
print("Chrome trace (open in https://ui.perfetto.dev):", prof.trace_path)
viz.readable(prof.operators.head(12))'''
PROFILE_MEMORY = '''import plotly.express as px

mem = prof.memory.iloc[::max(1, len(prof.memory) // 300)]
px.area(mem.assign(time_ms=mem.time_us / 1e3), x="time_ms",
        y=[c for c in mem.columns if c != "time_us"], title=prof.memory_note).show()'''
PROFILE_MONITOR = '''monitor = profiling.monitor_once(cfg, steps=3)
print(monitor.source, monitor.note)
monitor.figure().show()'''
PROFILE_NSIGHT = '''from labkit.measure import profiler

print(profiler.nsys_command(preset=preset))
print(profiler.ncu_command("gemm", launch_skip=4, nvtx_range="forward", preset=preset))'''

SLA_PARAMETERS = ('\npareto_batch_sizes = [1, 2, 4, 8]  # the Pareto figure: batch limits swept, backlog replays only'
                  '\npareto_variants = "continuous"  # the schedulers it compares beside the reference, e.g. "static,continuous"')
SLA_PARETO = '''from labkit.views import serving

pareto = run_experiment("sla", preset=preset, overrides={**overrides, "device": device, "search_steps": 0},
                        sweep={"batch_size": pareto_batch_sizes}, variants=pareto_variants.split(","),
                        runs_dir=runs_dir, progress=False).frame()
serving.pareto_figure(pareto).show()
serving.serving_points(pareto).round(3)'''
FINETUNE_PARAMETERS = ('\nfrontier_overrides = {"batch_size": 1}  # the frontier\'s sizes over the run\'s overrides'
                       '\nfrontier_seq_step = 16  # the frontier\'s granularity, tokens'
                       '\nfrontier_cpu_budget_gib = 0.06  # the frontier\'s virtual budget on a CPU (a GPU searches its memory)'
                       '\nlong_model = "mistral-7b"  # why LoRA still OOMs: a 7B model with a context of 8k or more'
                       '\nlong_seq_len = 8192  # its sequence length, tokens')
PACKING_FIGURES = '''from labkit.config import resolve
from labkit.techniques import packing
from labkit.views import packing as packing_views

packing_views.throughput_figure(frame).show()
pcfg = resolve(packing.Config, preset, {**overrides, "device": device}, experiment="packing")
packing_views.document_loss_figure(packing.document_loss_table(pcfg)).show()'''
CONTEXT_FIGURES = '''from labkit.config import resolve
from labkit.techniques import context_parallel
from labkit.views import context_parallel as cp_views

cp_views.per_rank_figure(frame).show()
cp_views.balance_figure(frame).show()
ccfg = resolve(context_parallel.Config, preset, {**overrides, "device": device, "nproc": nproc},
               experiment="context_parallel")
cp_views.scaling_figure(context_parallel.scaling_table(ccfg), frame).show()'''
MOE_FIGURES = '''from labkit.views import moe as moe_views

moe_views.drops_figure(frame).show()
moe_views.bytes_figure(frame).show()'''
MOE_MIXTRAL = '''import pandas as pd
from labkit import planner

mixtral = planner.MIXTRAL_8X7B
per_rank = planner.ep_memory(mixtral, 8, "bf16_weights", "adamw")
pd.Series({"parameters": planner.num_params(mixtral), "active per token": planner.active_params(mixtral),
           "routed experts": planner.expert_params(mixtral), "per rank at EP 8": per_rank["params"],
           "of which experts": per_rank["expert_params"], "of which replicated": per_rank["replicated_params"],
           "bf16 weights per rank, GiB": round(per_rank["param_bytes"] / 2**30, 2),
           "bf16_weights model states per rank, GiB": round(per_rank["model_states_bytes"] / 2**30, 2)},
          dtype=object)'''
FP8_FIGURES = '''from labkit.blocks import fp8 as fp8_formats
from labkit.config import resolve
from labkit.techniques import fp8
from labkit.views import fp8 as fp8_views

fcfg = resolve(fp8.Config, preset, {**overrides, "device": device}, experiment="fp8")
table = fp8.numerics_table(fcfg)
fp8_views.numerics_figure(table, {f: fp8_formats.rms_rounding_error(f) for f in fp8_formats.FORMATS}).show()
fp8_views.bounds_table(table)'''
GRAD_COMPRESSION_PARAMETERS = ('\nscale_model = "llama-3-8b"  # the at-scale table: a published shape'
                               '\nscale_world = 8  # its data-parallel ranks'
                               '\nscale_powersgd_rank = 4  # its PowerSGD rank'
                               '\nlink_gbps = 50.0  # its link, GB/s one direction (e.g. 400 Gb/s Ethernet)')
GRAD_COMPRESSION_FIGURES = '''from labkit.views import grad_compression as gc_views

gc_views.compression_figure(frame).show()'''
GRAD_COMPRESSION_SCALE = '''from labkit.techniques import grad_compression

viz.readable(grad_compression.scale_table(scale_model, world=scale_world, powersgd_rank=scale_powersgd_rank,
                                          link_gbps=link_gbps))'''
FINETUNE_MEMORY = '''from labkit.views import finetune as finetune_views

finetune_views.memory_figure(frame).show()'''
FINETUNE_FRONTIER = '''from labkit.config import resolve
from labkit.techniques import finetune

fcfg = resolve(finetune.Config, preset, {**overrides, **frontier_overrides, "device": device},
               experiment="finetune")
front = finetune.frontier(fcfg, None if fcfg.device.startswith("cuda") else frontier_cpu_budget_gib,
                          seq_step=frontier_seq_step)
finetune_views.frontier_figure(front).show()
front'''
FINETUNE_LONG_CONTEXT = '''import pandas as pd

from labkit import planner
from labkit.config import MODELS

kinds = {**{method: {"method": method} for method in planner.FINETUNE_METHODS},
         "qlora + full checkpointing": {"method": "qlora", "checkpointing": "full"}}
plans = {name: planner.finetune_memory(MODELS[long_model], batch_size=1, seq_len=long_seq_len,
                                       compute_dtype="bf16", device="cuda", **kw)
         for name, kw in kinds.items()}
pd.DataFrame({name: {**{t: getattr(p, f"{t}_bytes") / 2**30 for t in ("param", "grad", "optimizer", "activation")},
                     "peak": p.total_bytes / 2**30} for name, p in plans.items()}).T.round(2)  # GiB'''
RECIPE_PARAMETERS = ('\nladder_steps = {"precision": "bf16", "checkpointing": "full"}  # the ladder: recipe '
                     "knobs, one rung each, in compose's order")
# The rungs set the recipe's knobs themselves: the ladder and the timelines share only the sizes.
RECIPE_LADDER = '''from labkit.harness import ladder
from labkit.views.ladder import ladder_figure

sizes = {k: v for k, v in overrides.items() if k not in ladder.ORDER}
ladder_settings = {**sizes, "device": device, "nproc": nproc}
rungs = ladder.ladder_rungs(ladder_steps, preset=preset, overrides=ladder_settings)
steps = ladder.run_ladder(rungs, preset=preset, overrides=ladder_settings, runs_dir=runs_dir)
ladder_figure(steps).show()
display(viz.readable(ladder.verdicts(steps)))
viz.readable(ladder.job_throughput(steps))'''
RECIPE_TIMELINE = '''from labkit.blocks.recipe import Recipe
from labkit.config import resolve
from labkit.harness.timeline import compare_timelines
from labkit.techniques import recipe
from labkit.views.memory import timeline_figure

one = resolve(recipe.Config, preset, {**sizes, "device": device, "nproc": 1}, experiment="recipe")
timeline = compare_timelines(one, [Recipe(), Recipe(checkpointing="full"),
                                   Recipe(loss="chunked", loss_chunk=64), Recipe(optimizer="adamw8bit")])
timeline_figure(timeline).show()
peaks = timeline.groupby("recipe", sort=False).agg(measured_peak_bytes=("total_bytes", "max"),
                                                    predicted_peak_bytes=("predicted_peak_bytes", "first"))
viz.readable(peaks.assign(ratio=peaks["measured_peak_bytes"] / peaks["predicted_peak_bytes"]))'''
RECIPE_LEDGER = '''from labkit.harness.ledger import memory_ledger
from labkit.views.memory import ledger_figure

ledger = memory_ledger(one, Recipe(precision="bf16", checkpointing="full", loss="chunked", loss_chunk=64))
ledger_figure(ledger).show()
viz.readable(ledger.set_index("category"))'''
RECIPE_PANEL = '''if interactive:
    from labkit.ui.recipe_panel import recipe_panel

    display(recipe_panel(hf_model=hf_model))'''

WEIGHT_QUANT_BYTES = '''table = viz.metric_table(frame)
shown = [m for m in ("weight_bytes", "weight_bytes_ratio", "packed_layers", "dequant_layers",
                     "logit_rel_error", "next_token_agreement", "perplexity_delta_pct") if m in table.index]
viz.readable(table.loc[shown])'''
WEIGHT_QUANT_LOADING = '''import pandas as pd
from labkit.config import resolve
from labkit.techniques import weight_quant

cfg = resolve(weight_quant.Config, preset, {**overrides, "device": device, "variant": "int4"},
              experiment="weight_quant")
viz.readable(pd.DataFrame(weight_quant.loading_peaks(cfg)).set_index("loading"))'''
WEIGHT_QUANT_CALIBRATED = '''import pandas as pd
from labkit.techniques import weight_quant

beside = pd.DataFrame(weight_quant.against_rtn(viz.metric_table(frame).to_dict()))
viz.readable(beside.set_index("variant")) if len(beside) else print("run the calibrated variants beside int4, int8 and w8a8")'''
PIPELINE_TIMELINES = '''import pandas as pd
from labkit.config import resolve
from labkit.techniques import pipeline_parallel
from labkit.views import pipeline as pipeline_views

pcfg = resolve(pipeline_parallel.Config, preset, {**overrides, "device": device, "nproc": nproc},
               experiment="pipeline_parallel")
pipeline_views.timeline_figure(pd.DataFrame(pipeline_parallel.timelines(pcfg))).show()'''
PIPELINE_BUBBLES = '''from labkit.views import pipeline as pipeline_views

pipeline_views.bubble_figure(frame).show()'''
EXPERIMENTS = {  # name -> keyword arguments of experiment_notebook
    "mixed_precision": dict(predicted=("param_bytes", "optimizer_bytes", "activation_bytes", "step_ms")),
    "kv_cache": dict(extra=(("block_tables", KV_BLOCK_TABLE), ("int8", KV_INT8)),
                     predicted=("kv_bytes_per_token", "kv_waste_pct", "achieved_gbps")),
    "batching": dict(extra=(("latency", BATCHING_LATENCY), ("schedule", BATCHING_SCHEDULE),
                            ("tricks", BATCHING_TRICKS)),
                     predicted=("useful_tokens_per_s", "padding_waste_pct", "max_concurrent")),
    "checkpointing": dict(predicted=("activation_bytes", "peak_mem_bytes", "flops")),
    "grad_accumulation": dict(sweep='{"micro_batches": [1, 4]}',
                              predicted=("activation_bytes", "peak_mem_bytes")),
    "offload": dict(predicted=("peak_mem_bytes", "optimizer_bytes", "device_optimizer_bytes")),
    "memory_pool": dict(predicted=("kv_bytes", "peak_mem_bytes")),
    "collectives": dict(sweep='{"message_bytes": [4096, 65536, 1048576, 16777216]}',
                        predicted=("busbw_gbps", "step_ms"), fields=("nproc",), model=False),
    "data_parallel": dict(predicted=("comm_bytes", "peak_mem_bytes", "num_buckets")),
    "zero": dict(predicted=("param_bytes", "grad_bytes", "optimizer_bytes", "peak_mem_bytes")),
    "tensor_parallel": dict(predicted=("param_bytes", "activation_bytes", "comm_bytes", "comm_bus_bytes")),
    "pipeline_parallel": dict(extra=(("timelines", PIPELINE_TIMELINES), ("bubbles", PIPELINE_BUBBLES)),
                              predicted=("ideal_bubble_fraction",)),
    "hybrid": dict(predicted=("param_bytes", "peak_mem_bytes")),
    "recipe": dict(extra=(("predicted", "viz.readable(viz.predicted_table(frame))"),
                          ("ladder", RECIPE_LADDER), ("timeline", RECIPE_TIMELINE),
                          ("ledger", RECIPE_LEDGER), ("recipe_panel", RECIPE_PANEL)),
                   parameters=RECIPE_PARAMETERS,
                   predicted=("peak_mem_bytes", "param_bytes", "grad_bytes", "optimizer_bytes",
                              "activation_bytes")),
    "load_balance": dict(predicted=("param_bytes", "optimizer_bytes")),
    "attention": dict(sweep='{"seq_len": [256, 512, 1024]}', predicted=("activation_bytes", "flops"),
                      fields=("batch_size", "num_heads", "num_kv_heads", "dtype")),
    "compile": dict(sweep='{"target": ["block", "decode"]}', predicted=("flops",)),
    "fused_kernel": dict(sweep='{"rows": [256, 4096, 16384]}', predicted=("step_ms", "gbps"),
                         fields=("hidden_size", "dtype"), model=False),
    "matmul": dict(sweep='{"alignment": ["aligned", "off_by_one"]}', extra=(("roofline", MATMUL_ROOFLINE),),
                   predicted=("flops", "tflops", "step_ms"), fields=(), model=False),
    "memory_access": dict(sweep='{"stride": [2, 4, 8, 16]}', predicted=("gbps", "step_ms"), fields=("op",), model=False),
    "profiling": dict(extra=(("profile", PROFILE_ONCE), ("memory_timeline", PROFILE_MEMORY),
                             ("monitor", PROFILE_MONITOR), ("nsight", PROFILE_NSIGHT)),
                      predicted=("param_bytes", "optimizer_bytes", "step_ms")),
    "dataloading": dict(predicted=("compute_ms", "data_ms"),
                        fields=("batch_size", "seq_len", "sample_cost_us", "io_latency_us", "num_workers")),
    "threads": dict(extra=(("env_knobs", "from labkit.techniques import threads\n\nprint(threads.env_note())"),),
                    predicted=("num_threads_seen", "speedup"), fields=("work",)),
    "sla": dict(extra=(("pareto", SLA_PARETO), ("cost", "serving.cost_figure(pareto).show()")),
                parameters=SLA_PARAMETERS,
                predicted=("saturation_requests_per_s", "usd_per_million_tokens", "rates_tried", "bracket_ratio")),
    "finetune": dict(extra=(("memory", FINETUNE_MEMORY), ("frontier", FINETUNE_FRONTIER),
                            ("long_context", FINETUNE_LONG_CONTEXT)),
                     parameters=FINETUNE_PARAMETERS,
                     predicted=("trainable_params", "linear_weight_bytes", "optimizer_bytes",
                                "activation_bytes", "peak_mem_bytes"),
                     fields=("lora_rank", "lora_targets", "batch_size", "seq_len")),
    "packing": dict(extra=(("figures", PACKING_FIGURES),),
                    predicted=("padding_fraction", "speedup", "attention_pairs", "peak_mem_bytes"),
                    fields=("batch_size", "seq_len", "median_len", "length_sigma")),
    "context_parallel": dict(extra=(("figures", CONTEXT_FIGURES),),
                             predicted=("comm_bytes", "comm_bus_bytes", "activation_bytes", "attended_pairs"),
                             fields=("batch_size", "seq_len", "num_heads", "num_kv_heads", "nproc"), model=False),
    "moe": dict(sweep='{"capacity_factor": [1.0, 1.25, 2.0]}',
                extra=(("figures", MOE_FIGURES), ("mixtral", MOE_MIXTRAL)),
                predicted=("param_bytes", "expert_param_bytes", "capacity_tokens", "load_imbalance",
                           "offrank_bytes"),
                fields=("batch_size", "seq_len", "num_experts", "experts_per_token", "capacity_factor", "nproc")),
    "grad_compression": dict(extra=(("figures", GRAD_COMPRESSION_FIGURES), ("scale", GRAD_COMPRESSION_SCALE)),
                             parameters=GRAD_COMPRESSION_PARAMETERS,
                             predicted=("grad_comm_bytes", "grad_bus_bytes", "compression_ratio", "num_buckets"),
                             fields=("batch_size", "seq_len", "bucket_cap_mb", "powersgd_rank", "nproc")),
    "fp8": dict(extra=(("figures", FP8_FIGURES), ("outliers", "fp8.outlier_rows(fcfg)")),
                predicted=("e4m3_max_rel_error", "e5m2_max_rel_error", "max_rel_error", "fp8_weight_bytes",
                           "fp8_input_bytes"),
                fields=("batch_size", "seq_len", "compute", "kernel")),
    "speculative": dict(extra=(("formula", SPEC_FORMULA),),
                        predicted=("token_agreement", "tokens_per_step", "speedup")),
    "weight_quant": dict(extra=(("bytes", WEIGHT_QUANT_BYTES), ("calibrated", WEIGHT_QUANT_CALIBRATED),
                                ("loading", WEIGHT_QUANT_LOADING)),
                         predicted=("weight_bytes", "weight_bytes_ratio", "tokens_per_s",
                                    "load_peak_mem_bytes"),
                         fields=("dtype", "group_size", "kernel", "loading")),
}


def prose_notebook(stem: str, parameters: str, steps: tuple, call: str | None = None) -> nbformat.NotebookNode:
    """A notebook of its own shape: the text's `intro`, the `parameters` cell, each step
    (a section of the text, or None, then its code cells), then `look_for` where the text has one."""
    text = read_text(stem)
    cells = [new_markdown_cell(text["intro"]), new_code_cell(parameters, metadata={"tags": ["parameters"]})]
    for section, *codes in steps:
        cells += ([new_markdown_cell(text[section])] if section else []) + [new_code_cell(c) for c in codes]
    return new_notebook(metadata=KERNEL, cells=cells + (look_for(text, call) if "look_for" in text else []))


DESCRIBE = "from labkit import hardware\n\nprint(hardware.describe())"

ENVIRONMENT = ('device = "auto"  # auto, cpu, cuda or cuda:N\npreset = None  # None: chosen from the device', (
    (None, "import pandas as pd\n\nfrom labkit import hardware\n\nprint(hardware.describe())"),
    ("devices", "from labkit.views import plots as viz\n\nviz.readable(pd.DataFrame(hardware.architecture()))"),
    ("ceilings", '''from labkit.config import resolve_device

ceil = hardware.ceilings(resolve_device(device))
print(ceil.name, '|', ceil.source)
viz.readable(pd.DataFrame({'peak TFLOP/s': ceil.peak_tflops,
                           'calibrated TFLOP/s': ceil.calibrated_tflops}).assign(
    **{'bandwidth GB/s': ceil.bandwidth_gbps,
       'ridge FLOP/byte': lambda t: t['peak TFLOP/s'] * 1e12 / ((ceil.bandwidth_gbps or float('nan')) * 1e9)}))'''),
    ("knobs", "hardware.env_knobs() or 'none set'",
     "import torch\n\nprint(torch.__config__.parallel_info())  # thread pools, OpenMP/MKL, their knobs"),
    ("lab_plan", "from labkit.harness.experiment import lab_plan\n\npd.DataFrame(lab_plan(device, preset))"),
))

BATCH_FINDER = ('''preset = None  # model shape and sizes: tiny, small, medium, gpt2-124m, ...; None: from the device
device = "auto"  # auto, cpu, cuda or cuda:N
variants = "all"  # comma-separated variants to run beside the reference, or "all"
seq_lens = [16, 32, 64]  # one search per sequence length: the frontier's x axis
cpu_budget_gib = 0.25  # the virtual memory budget on the CPU (a GPU searches its real memory)
overrides = {}  # any config field, e.g. {"mode": "dynamic", "effective_batch": 64}
interactive = True  # show the widget panel to re-run with other settings
runs_dir = None  # where results are stored (None: $LABKIT_RUNS_DIR or ./runs)''', (
    ("machine", DESCRIBE),
    ("run", '''from labkit.harness.experiment import run_experiment
from labkit.techniques.batch_finder import budget_overrides
from labkit.ui.widgets import build_panel

settings = {**budget_overrides(device, cpu_budget_gib), **overrides, "device": device}
result = run_experiment("batch_finder", preset=preset, overrides=settings, sweep={"seq_len": seq_lens},
                        variants=None if variants == "all" else variants.split(","),
                        runs_dir=runs_dir, progress=False)
frame = result.frame()'''),
    ("frontier", "from labkit.views import plots as viz\n\nviz.frontier(frame).show()"),
    ("predicted", "display(viz.readable(viz.predicted_table(frame)))\nviz.not_run(frame)"),
    ("numbers", "viz.readable(viz.metric_table(frame))"),
    ("panel", '''if interactive:
    display(build_panel("batch_finder", preset=preset, device=device, overrides=overrides,
                        runs_dir=runs_dir))'''),
))
BATCH_FINDER_CALL = predicted_call("batch_finder", ("max_batch_size", "accumulation_steps"), "settings",
                                   '{"seq_len": seq_lens}', ("memory_budget_gib", "mode"))

PLANNER = ('''model = "llama-2-7b"  # the worked example's model: a preset (tiny, small, gpt2-124m, llama-2-7b, ...)
gpus = 4  # GPUs the worked example trains on (data parallel)
gpu_mem_gib = 24.0  # memory of each of those GPUs, GiB
seq_len = 4096  # tokens per sequence in the worked example
effective_batch = 32  # sequences per optimizer step in the worked example
check_overrides = {"batch_size": 4, "seq_len": 64}  # sizes of the tiny run measured here to check the planner
device = "auto"  # where that check runs: auto, cpu, cuda or cuda:N
nproc = None  # gloo ranks of the worked example at CPU scale (None: as many as the cores hold, 2 to 4)
measured = {"batch_size": 8, "seq_len": 128, "num_layers": 2, "steps": 2, "timed_steps": 2, "warmup": 0,
            "min_run_time_s": 0.0, "device": "cpu"}  # its sizes (tiny preset): batch_size is per rank
measured_micro_batches = 4  # the last rung: each rank's batch of 8 in this many micro-batches
interactive = True  # show the planner panel to try other inputs
runs_dir = None  # where the check's results are stored (None: $LABKIT_RUNS_DIR or ./runs)''', (
    ("machine", DESCRIBE),
    ("worked_example", '''from labkit.views import plan as plan_view, plots as viz

steps = plan_view.worked_example(model=model, gpus=gpus, gpu_mem_gib=gpu_mem_gib,
                                 seq_len=seq_len, effective_batch=effective_batch)
viz.readable(plan_view.worked_table(steps))''',
     'plan_view.stacked_terms(steps, title=f"{model}: predicted peak per GPU").show()'),
    ("recommended_plan", 'print(plan_view.format_plan(steps["recommended"]))'),
    ("check", '''from labkit.harness.experiment import run_experiment

check = run_experiment("mixed_precision", preset="tiny", variants=["fp32"],
                       overrides={**check_overrides, "device": device},
                       runs_dir=runs_dir, progress=False)
viz.readable(plan_view.measured_vs_predicted(check.frame()))'''),
    ("measured_budget", '''from labkit.config import usable_threads
from labkit.harness import ladder

story = {"precision": "bf16", "checkpointing": "full", "micro_batches": measured_micro_batches}
nproc = nproc or ladder.cpu_ranks()
print(f"the worked example runs on {nproc} gloo ranks, one thread each: this machine lets labkit use "
      f"{usable_threads()} core(s), so {ladder.cpu_ranks()} ranks share none (2 to 4)")
settings = {**measured, "nproc": nproc}
rungs = ladder.ladder_rungs(story, preset="tiny", overrides=settings)
peaks = ladder.predicted_peaks(rungs, preset="tiny", overrides=settings)
# The budget: the last rung fits it, and the smallest of the rungs before it does not
budget_gib = ladder.budget_between(peaks[rungs[-1].label], min(peaks[r.label] for r in rungs[1:-1]))
print(f"virtual budget per rank: {budget_gib * 1024:.1f} MiB")
for label, peak in peaks.items():
    verdict = "reference, no budget" if label == "plain" else ("fits" if peak <= budget_gib * 2**30 else "does not fit")
    print(f"  {label}: predicted {peak / 2**20:.1f} MiB per rank, {verdict}")'''),
    ("measured_run", '''from labkit.views.ladder import ladder_figure

worked = ladder.run_ladder(rungs, preset="tiny", overrides={**settings, "budget_gib": budget_gib},
                           runs_dir=runs_dir)
ladder_figure(worked, title=f"the worked example measured: {nproc} ranks, "
                            f"batch {measured['batch_size']} per rank").show()
viz.readable(ladder.verdicts(worked))'''),
    ("balanced", '''spread = ladder.balance(worked)
print(f"every rank's peak within {ladder.BALANCE_PCT:g}% of the busiest rank's, on every rung that ran: "
      f"{bool(spread['balanced'].all())}")
viz.readable(spread)'''),
    ("panel", '''if interactive:
    display(plan_view.build_plan_panel(model=model, gpus=gpus, gpu_mem_gib=gpu_mem_gib,
                                       seq_len=seq_len, effective_batch=effective_batch))'''),
))

COMPARE = ('''runs_dir = None  # stored runs: yours, or a colleague's copied in; None: $LABKIT_RUNS_DIR or ./runs
price_per_gpu_hour = None  # what a GPU-hour costs you, e.g. 2.5; None: no cost (no price is assumed)
model = "llama-2-7b"  # the fit table's model: a preset (tiny, small, gpt2-124m, llama-2-7b, llama-3-70b, ...)
selfcheck = None  # your `labkit selfcheck --out` file, shown beside the H200 reference; None: the reference alone
interactive = True  # show the panels: pick runs, enter prices, try other fit settings''', (
    ("machine", DESCRIBE),
    ("runs", '''from labkit import views
from labkit.views import plots as viz
from labkit.results import load_results, runs_dir as store

frame = load_results(runs_dir)
runs = views.run_table(runs_dir)
if runs.empty:
    print(f'no runs stored yet in {store(runs_dir).resolve()}: run an experiment, '
          'or copy run files there')
else:
    display(runs.drop(columns='label'))'''),
    ("latest", '''latest = views.latest_runs(frame, n=3)
if latest:
    name = runs.set_index('run_id').loc[latest[-1], 'experiment']
    views.compare_runs(frame, latest, title=f'{name}: the latest runs').show()
else:
    print('no measured runs to compare yet')'''),
    ("cost", '''cost = views.cost_table(frame, price_per_gpu_hour)
if cost.empty:
    print('no measured tokens_per_s rows yet: nothing to price')
else:
    display(viz.readable(cost.drop(columns='run_id')))'''),
    ("fit", '''fit = views.fit_table(model, precision='bf16_pure', zero_stage=3, checkpointing='full')
views.fit_figure(fit, title=f'{model}: fewest GPUs that fit').show()
viz.readable(fit)'''),
    ("reference", '''import json
from pathlib import Path

mine = json.loads(Path(selfcheck).read_text()) if selfcheck else None
viz.readable(views.selfcheck_table(mine), by_metric=('h200', 'yours'))'''),
    ("panel", '''if interactive:
    display(views.comparison_panel(runs_dir))
    display(views.cost_panel(frame))
    display(views.fit_panel(model))'''),
))

LEADERBOARD = ('''runs_dir = None  # the room's shared folder (None: $LABKIT_RUNS_DIR or ./runs)
# metric: tokens_per_s, useful_tokens_per_s, requests_per_s, tflops, gbps, step_ms, peak_mem_bytes,
# bubble_fraction
metric = "tokens_per_s"  # what the side-by-side tables and the bars rank
preset = None  # only runs at this preset (tiny, small, medium, ...); None: every preset
by = "participant"  # the learning view: participant or team
interactive = True  # the live panel: choose the metric and grouping, Refresh as the room runs''', (
    ("who", '''from labkit.study import leaderboard as lb
from labkit.results import runs_dir as store
from labkit.views.plots import readable

rows = lb.load_board(runs_dir, preset)
people, machines = sorted(set(rows['participant'])), rows['machine'].nunique()
print(f"{rows['run_id'].nunique()} runs, {len(rows)} measurements by "
      f"{len(people)} participants ({', '.join(people) or 'none yet'}) on "
      f"{machines} machines, read from {store(runs_dir).resolve()}")'''),
    ("challenges", "readable(lb.best_per_challenge(rows))"),
    ("by_machine", "readable(lb.side_by_side(rows, metric, by='machine'), metric=metric)"),
    ("by_participant", "readable(lb.side_by_side(rows, metric, by='participant'), metric=metric)"),
    ("best", '''best = lb.entries(rows, metric)
if best.empty:
    print(f'no {metric} measured yet: run an experiment that measures it')
else:
    lb.figure(rows, metric).show()
readable(best, metric=metric)'''),
    ("learning", '''attempts = lb.load_learning(runs_dir)
if attempts.empty:
    print('no exercise attempts yet: answer one in notebooks/exercises/')
lb.learning_view(attempts, by)'''),
    ("hardest", "lb.hardest_exercises(attempts)"),
    ("live", "if interactive:\n    display(lb.leaderboard_panel(runs_dir, metric, preset))"),
))

QUIZ = ('''mode = "practice"  # practice (random draw), review (wrong answers first, then unseen), mock (timed exam)
topic = "all"  # all, memory, parallelism, distributed, profiling, inference, precision, operations (not in mock)
n = 10  # questions per quiz (mock: per exam)
minutes = None  # mock only: the time allowed (None: 2 minutes a question, the exam's pace)
seed = None  # a number: the same questions and choice order every time (a class sharing one quiz)
progress = None  # progress file (None: $LABKIT_QUIZ_PROGRESS or ~/.labkit/quiz_progress.json)
interactive = True  # the quiz widget; False: print the drawn questions with their answers (an answer key)''', (
    ("bank", '''from labkit.study import quiz

bank = quiz.load_bank()
print(quiz.format_stats(quiz.bank_stats(bank, seed=0)))
print("mock-exam weights:", quiz.TOPIC_WEIGHTS)'''),
    ("quiz", '''if interactive:
    display(quiz.quiz_panel(topic, n, seed=seed, progress=progress, mode=mode, minutes=minutes))
else:
    drawn = (quiz.mock_exam(n, minutes, seed, bank).questions if mode == "mock" else
             quiz.draw(topic, n, seed, bank, order="review" if mode == "review" else "random",
                       progress=progress))
    for i, q in enumerate(drawn, 1):
        print(f"{i}. [{quiz.TOPICS[q.topic]}] {q.question}")
        for j, (choice, why) in enumerate(zip(q.choices, q.feedback)):
            print(f"   {'*' if j == q.answer else ' '} {chr(65 + j)}. {choice}\\n        {why}")
        print(f"   Why: {q.explanation}\\n   Measure it: {q.notebook}\\n")'''),
    ("progress", "quiz.progress_summary(progress)"),
))


def build_all() -> dict[str, nbformat.NotebookNode]:
    """Every notebook by file name: one per experiment with a notebook in its record, and the rest."""
    out = {"00_environment.ipynb": prose_notebook("00_environment", *ENVIRONMENT),
           "07_batch_finder.ipynb": prose_notebook("07_batch_finder", *BATCH_FINDER, BATCH_FINDER_CALL),
           "08_memory_planner.ipynb": prose_notebook("08_memory_planner", *PLANNER),
           "25_quiz.ipynb": prose_notebook("25_quiz", *QUIZ),
           "98_leaderboard.ipynb": prose_notebook("98_leaderboard", *LEADERBOARD),
           "99_compare.ipynb": prose_notebook("99_compare", *COMPARE)}
    for name, rec in records().items():
        if rec.notebook and name in EXPERIMENTS:
            out[Path(rec.notebook).name] = experiment_notebook(name, **EXPERIMENTS[name])
    return dict(sorted(out.items()))


def with_stable_ids(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"  # stable ids: a rebuild changes only what was edited
    return nb


NOTEBOOKS = {filename: with_stable_ids(nb) for filename, nb in build_all().items()}

if __name__ == "__main__":
    for filename, nb in NOTEBOOKS.items():
        nbformat.validate(nb)
        nbformat.write(nb, ROOT / filename)
        print("wrote", ROOT / filename)
