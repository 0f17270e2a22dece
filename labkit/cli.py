"""The command line: `labkit env | list | run | results | report | plan | selfcheck | ...`.

Bad input is one line on stderr and exit code 2, never a traceback: a folder or file to write
(`--runs-dir`, `--out`, `--trace`) is checked by a write before anything runs. Ctrl-C exits 130.
`--json` prints result rows as JSON lines on stdout and nothing else.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence

from labkit.config import PRESETS, ConfigError, parse_assignments, parse_sweep

EXIT_BAD_INPUT = 2
HF_MODEL_HELP = ("a Hugging Face folder (config.json, optionally safetensors weights: llama, "
                 "mistral, qwen2 or gpt2) whose shape replaces the preset's")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; we want one line
        raise ConfigError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="labkit", description="Measure what LLM optimizations do to memory and speed.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    env = sub.add_parser("env", help="this machine: devices, ceilings, environment")
    env.add_argument("--json", action="store_true")
    lst = sub.add_parser("list", help="experiments and their variants")
    lst.add_argument("--json", action="store_true")
    run = sub.add_parser("run", help="run one experiment")
    run.add_argument("name")
    _add_run_options(run)
    run.add_argument("--variant", action="append", default=[], metavar="V",
                     help="variant(s) to run besides the reference (repeat or comma-separate)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    run.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2,...")
    run.add_argument("--json", action="store_true", help="result rows as JSON lines on stdout")
    run.add_argument("--hf-model", metavar="DIR", help=HF_MODEL_HELP + "; sizes still come from "
                     "--preset and --set (e.g. --set num_layers=2 shrinks it, with random weights)")
    run.add_argument("--budget-s", type=float, metavar="S", default=None,
                     help="on a CPU at the tiny preset, size the defaults down until this run is "
                          "predicted to take at most S seconds here (default: 40; 0: never; "
                          "settings given with --set or --sweep are kept)")
    run.add_argument("--nproc", type=int, metavar="N",
                     help="ranks of a multi-process experiment (default: one per visible GPU, "
                          "else 2 CPU ranks; under torchrun: its world size)")
    res = sub.add_parser("results", help="stored results; export or import a bundle of them",
                         description="labkit results [show]: the stored rows. labkit results export "
                         "--out FILE.zip: the run files and a manifest with a checksum per file. "
                         "labkit results import FILE.zip: add a bundle's runs (exit 2, nothing "
                         "written, when it is corrupted).")
    res.add_argument("action", nargs="?", default="show", choices=("show", "export", "import"))
    res.add_argument("bundle", nargs="?", help="import: the bundle to add")
    res.add_argument("--experiment", help="only this experiment's runs (show, export)")
    res.add_argument("--participant", help="export: only this participant's runs")
    res.add_argument("--out", help="export: the bundle to write (a .zip)")
    res.add_argument("--run-id")
    res.add_argument("--runs-dir", help="the store (default: $LABKIT_RUNS_DIR or runs/)")
    res.add_argument("--json", action="store_true")
    rep = sub.add_parser("report", help="execute the notebooks (papermill, report mode) and render "
                         "them to offline HTML pages with an index",
                         description="Exit code: 0 when every notebook ran, 1 when any failed (after "
                                     "all of them ran; the index names the error), 2 on bad input.")
    rep.add_argument("--out", default="lab-report", help="folder for the pages, index.html and runs/")
    rep.add_argument("--only", action="append", default=[], metavar="NAME",
                     help="experiments (matmul) or notebooks (20_matmul) to run (repeat or "
                          "comma-separate; default: every notebook outside notebooks/exercises/)")
    rep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                     help="a setting given to every notebook whose experiment takes it")
    rep.add_argument("--jobs", type=int, default=None, help="core slots (default: the cores this "
                     "process may use; 2 on a GPU); a notebook takes one per rank it starts, at most all")
    rep.add_argument("--budget-s", type=float, default=None, metavar="S",
                     help="on a CPU at the tiny preset, size each notebook to its share of S seconds "
                          "before it runs (default: 480, for a goal of 600; 0: never)")
    rep.add_argument("--dry-run", action="store_true",
                     help="print each notebook's predicted seconds here, its sizing and the total; run nothing")
    _add_run_options(rep)
    prof = sub.add_parser("profile", help="one step of one experiment under torch.profiler: "
                                          "findings, top operators, a Chrome trace")
    prof.add_argument("name")
    _add_run_options(prof)
    prof.add_argument("--variant", help="the variant to profile (default: the reference)")
    prof.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides")
    prof.add_argument("--trace", default="labkit_trace.json", help="Chrome trace file to write "
                      "(open it in https://ui.perfetto.dev)")
    prof.add_argument("--top", type=int, default=10, help="operators to list")
    lab = sub.add_parser("lab", help="start JupyterLab on notebooks/ (127.0.0.1 only, token on)")
    lab.add_argument("--port", type=int, default=8888, help="port on 127.0.0.1 (default: 8888)")
    lab.add_argument("--dry-run", action="store_true", help="print the command; start nothing")
    cal = sub.add_parser("calibrate", help="measure this device's matmul and copy ceilings "
                                           "(stored; the roofline prefers them to the datasheet)")
    cal.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    cal.add_argument("--runs-dir", help="where results are stored (default: $LABKIT_RUNS_DIR or runs/)")
    cal.add_argument("--sizes", help="square matmul sizes to scan, comma-separated "
                                     "(default: 256,512,1024 on a CPU, 4096,8192,16384 on a GPU)")
    _add_plan_parser(sub)
    _add_train_reference_parser(sub)
    return p


def _add_train_reference_parser(sub) -> None:
    from labkit.blocks.reference import DEFAULTS, REFERENCE_DIR

    tr = sub.add_parser("train-reference", help="train the reference model on labkit's synthetic "
                                                "language; write its weights and record")
    tr.add_argument("--steps", type=int, help=f"optimizer steps (default: {DEFAULTS['steps']})")
    tr.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="weights and data seed")
    tr.add_argument("--out", default=str(REFERENCE_DIR), help="folder for reference.safetensors "
                    "and reference.json (default: the shipped data/reference)")
    tr.add_argument("--quick", action="store_true", help="a few tiny steps (a smoke test)")
    tr.add_argument("--draft", action="store_true", help="the speculative experiment's draft "
                    "instead (draft.safetensors, draft.json; 2000 steps by default)")


def _add_plan_parser(sub) -> None:
    """`labkit plan`: choices are checked by the planner (one line naming the valid ones)."""
    sc = sub.add_parser("selfcheck", help="every experiment family at this device's size, within a "
                        "time budget, checked against what a healthy device shows",
                        description="Exit code: 0 when every check passed or was skipped with a "
                                    "reason, 1 when one failed, 2 on bad input.")
    sc.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    sc.add_argument("--budget-s", type=float, default=None,
                    help="seconds for all families (default: 600 on a CPU, which runs a check for "
                         "every experiment, seven of them multi-process; 300 on a GPU). Runs are "
                         "sized from the device's measured rates to fit; families that still do "
                         "not fit are left out, said so")
    sc.add_argument("--family", help="a comma list of families to run, in that order (default: "
                    "every family, cheapest first); an unknown name's error lists them")
    sc.add_argument("--out", help="write the checks and the environment as JSON here")
    sc.add_argument("--runs-dir", help="where results are stored (default: $LABKIT_RUNS_DIR or runs/)")
    sc.add_argument("--recheck", metavar="RECORD", help="measure nothing: evaluate today's checks on "
                    "the runs a stored record names (written back to it, or to --out)")
    pl = sub.add_parser("plan", help="predict training memory per GPU; recommend a plan that fits")
    pl.add_argument("--model", help=f"a preset: {', '.join(PRESETS)} (default: tiny)")
    pl.add_argument("--hf-model", metavar="DIR", help=HF_MODEL_HELP + " (read from config.json alone)")
    pl.add_argument("--params", help="a bare parameter count instead of --model, e.g. 7.5e9 "
                                     "(then only model states are predicted)")
    pl.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch per GPU")
    pl.add_argument("--seq-len", type=int, help="tokens per sequence (default: 2048 or the context)")
    pl.add_argument("--precision", default="bf16_weights", help="as the recipe names it: fp32, "
                    "tf32, bf16 or fp16 (autocast over fp32 weights), bf16_weights (16-bit weights "
                    "and gradients, fp32 master weights and optimizer states; default), or "
                    "bf16_pure / fp16_pure (everything in 16 bits)")
    pl.add_argument("--optimizer", default="adamw", help="adam, adamw or sgd (with momentum)")
    pl.add_argument("--optimizer-impl", default="foreach",
                    help="torch's Adam implementation: foreach (CUDA's default), single or fused")
    pl.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage 0-3")
    pl.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    pl.add_argument("--ep", type=int, default=1, help="expert-parallel degree (a mixture-of-experts "
                    "model): one rank's experts and replicated weights")
    pl.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages")
    pl.add_argument("--gpus", type=int, help="GPUs in all (default: tp x pp); dp = gpus / (tp x pp)")
    pl.add_argument("--gpu-mem-gib", type=float, default=80.0, help="memory of one GPU (GiB)")
    pl.add_argument("--checkpointing", default="none", help="none, selective or full")
    pl.add_argument("--effective-batch", type=int,
                    help="sequences per optimizer step (default: batch size x dp)")
    pl.add_argument("--finetune", help="full, lora, qlora, lora_int8 or lora_int4 (LoRA on an "
                    "NF4, int8 or int4 base): plan a fine-tuning step on one GPU "
                    "(frozen base, adapters; and the longest sequence / largest micro-batch per method)")
    pl.add_argument("--lora-rank", type=int, default=8, help="LoRA rank r (default: 8)")
    pl.add_argument("--lora-alpha", type=float, default=16.0,
                    help="LoRA alpha (scales the update alpha / r; no effect on memory)")
    pl.add_argument("--lora-targets", default="q,v", help="comma list of q, k, v, o, gate, up, "
                    "down, or attn / all (default: q,v)")
    pl.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="model shape and sizes (default: from the device)")
    p.add_argument("--device", help="auto, cpu, cuda or cuda:N (default: auto)")
    p.add_argument("--runs-dir", help="where results are stored (default: $LABKIT_RUNS_DIR or runs/)")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"labkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:  # a path the up-front checks could not foresee (a disk that filled up)
        print(f"labkit: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("labkit: interrupted; rows measured so far are stored", file=sys.stderr)
        return 130


def writable_folder(path: str | os.PathLike, option: str, *, named: str | None = None) -> Path:
    """`path`, created and checked by writing a file in it, before anything runs: a ConfigError
    line otherwise (a path under /proc, a read-only folder, a file). `named`: the path the user
    gave, when `path` is its folder."""
    from labkit.results import probe_folder

    folder = Path(path)
    try:
        probe_folder(folder)
    except OSError as e:
        where = f"{named}: cannot write in {folder}" if named else f"{folder}: cannot write there"
        raise ConfigError(f"{option} {where} ({e.strerror or e}); give a path you can write to"
                          ) from None
    return folder


def writable_file(path: str | os.PathLike, option: str) -> Path:
    """`path`, a file that can be written: no folder, in a folder that can be written."""
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{option} {target}: it is a folder; give a file name")
    writable_folder(target.parent, option, named=str(target))
    if target.exists() and not os.access(target, os.W_OK):
        raise ConfigError(f"{option} {target}: the file is read-only; give a file you can write")
    return target


def checked_runs_dir(path: str | os.PathLike | None) -> Path:
    """The runs folder (`--runs-dir`, else $LABKIT_RUNS_DIR, else runs/), checked by a write."""
    from labkit.results import RunsDirError, writable_runs_dir

    try:
        return writable_runs_dir(path)
    except RunsDirError as e:
        raise ConfigError(str(e)) from None


def cmd_env(args: argparse.Namespace) -> int:
    from labkit import hardware

    if args.json:
        info = {"fingerprint": hardware.fingerprint(), "ceilings": vars(hardware.ceilings("auto"))}
        print(json.dumps(info, default=str))
        return 0
    print(hardware.describe())
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from labkit.techniques import records

    entries = [{"experiment": name, "reference": exp.reference, "variants": list(exp.variants),
                "summary": exp.summary} for name, exp in records().items()]
    if args.json:
        for e in entries:
            print(json.dumps(e))
        return 0
    for e in entries:
        variants = ", ".join(v + (" (reference)" if v == e["reference"] else "") for v in e["variants"])
        print(f"{e['experiment']:<18} {variants}\n{'':<18} {e['summary']}")
    return 0


def split_variants(items: list[str]) -> list[str]:
    return [v for item in items for v in item.split(",") if v]


def _overrides(args: argparse.Namespace) -> dict[str, str]:
    overrides = parse_assignments(args.overrides) if getattr(args, "overrides", None) else {}
    if args.device:
        overrides["device"] = args.device
    return overrides


def cmd_run(args: argparse.Namespace) -> int:
    """Rows on stdout (rank 0 only under torchrun); a multi-process run that a rank cut short
    prints what was measured, then one line naming the rank and the cause, and exits 1."""
    from labkit.harness import launch
    from labkit.harness.budget import RUN_TARGET_S
    from labkit.harness.ranks import RunFailed
    from labkit.harness.experiment import run_experiment
    from labkit.techniques import record

    overrides = _overrides(args)
    if args.hf_model:
        overrides["model"] = hf_model_config(args.hf_model)
    if args.nproc is not None:
        _check_multiprocess(args.name)
        overrides["nproc"] = args.nproc
    try:
        result = run_experiment(args.name, preset=args.preset, overrides=overrides,
                                sweep=parse_sweep(args.sweep), variants=split_variants(args.variant),
                                runs_dir=args.runs_dir, progress=not args.json and sys.stderr.isatty(),
                                budget_s=_budget_s(args.budget_s, RUN_TARGET_S))
    except RunFailed as e:
        _print_result(e.result, args.json)
        print(f"labkit: error: {e}", file=sys.stderr)
        return 1
    sizing = next((r["params"]["sizing"] for r in result.rows if r["params"].get("sizing")), "")
    if sizing:
        print(f"labkit: {sizing}", file=sys.stderr)
    failed = reference_failure(record(args.name).reference, result.rows)
    if os.environ.get("RANK", "0") == "0":
        _print_result(result, args.json)
        if failed:
            print(f"labkit: error: {failed}", file=sys.stderr)
    code = 1 if failed else 0
    if "RANK" in os.environ and record(args.name).distributed:
        launch.leave(code)  # a torchrun rank, its rows stored: see launch.leave
    return code


def _budget_s(given: float | None, default: float) -> float:
    """--budget-s of `labkit run` and `labkit report`: `default` when not given; 0: never size."""
    if given is not None and given < 0:
        raise ConfigError(f"--budget-s {given:g}: seconds >= 0 (0: never size down)")
    return default if given is None else given


def reference_failure(reference: str, rows: list[dict]) -> str:
    """Why no verdict is possible: the reference's first `error` row (an exception or a failed
    check), or "" when it has none. `oom` and `skipped` rows are results, the reference's too."""
    bad = next((r for r in rows if r["variant"] == reference and r["status"] == "error"), None)
    if bad is None:
        return ""
    point = (bad.get("params") or {}).get("sweep") or {}
    where = f" at {', '.join(f'{k}={v}' for k, v in point.items())}" if point else ""
    return (f"the reference ({reference}) failed{where}, so no variant can be judged: "
            f"{bad['message']}")


def _check_multiprocess(name: str) -> None:
    from labkit.techniques import record, records

    if not record(name).distributed:
        multi = [n for n, exp in records().items() if exp.distributed]
        raise ConfigError(f"{name} runs in one process; --nproc applies to: {', '.join(multi)}")


def _print_result(result, as_json: bool) -> None:
    from labkit.results import format_rows

    if as_json:
        for row in result.rows:
            print(json.dumps(row, default=str, allow_nan=False))
        return
    print(format_rows(result.rows))
    print(f"\nstored as {result.path}")


def cmd_results(args: argparse.Namespace) -> int:
    from labkit.results import format_rows, load_results

    if args.action != "show" or args.bundle:
        return _results_bundle(args)
    frame = load_results(args.runs_dir, experiment=args.experiment, run_id=args.run_id)
    if args.json:
        frame = frame.astype(object).where(frame.notna(), None)  # missing -> null, never NaN
        for row in frame.to_dict(orient="records"):
            print(json.dumps(row, default=str, allow_nan=False))
        return 0
    if frame.empty:
        print("no stored results")
        return 0
    for run_id, rows in frame.groupby("run_id", sort=False):
        print(f"== {run_id}")
        print(format_rows(rows.to_dict(orient="records")))
    return 0


def _results_bundle(args: argparse.Namespace) -> int:
    """`labkit results export|import`: a corrupted or absent bundle is one line, exit 2."""
    from labkit.results import BundleError, RunsDirError, export_bundle, import_bundle, runs_dir

    if args.action == "export":
        if not args.out or args.bundle:
            raise ConfigError("results export writes one bundle: give --out FILE.zip (no other name)")
        writable_file(args.out, "--out")
        m = export_bundle(args.out, args.runs_dir, experiment=args.experiment,
                          participant=args.participant)
        c = m["counts"]
        print(f"exported {c['runs']} runs ({c['rows']} rows, {c['files']} files) from "
              f"{runs_dir(args.runs_dir)} to {args.out}")
        return 0
    if args.action != "import" or not args.bundle or args.out:
        raise ConfigError("give: labkit results export --out FILE.zip, or labkit results import FILE.zip")
    try:  # nothing is written, not even the store, before the bundle has passed its checks
        done = import_bundle(args.bundle, args.runs_dir)
    except (BundleError, RunsDirError) as e:
        raise ConfigError(str(e)) from None
    print(f"imported {args.bundle} into {runs_dir(args.runs_dir)}: {done['added']} added, "
          f"{done['updated']} updated, {done['unchanged']} already there"
          + (f"; kept {len(done['kept'])} differing files already there: {', '.join(done['kept'])}"
             if done["kept"] else ""))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """Exit 1 when a notebook failed, once every notebook has run; bad input exits 2 first."""
    from labkit.config import resolve_device
    from labkit.report import (check_settings, choose_notebooks, describe_report, find_notebooks,
                               run_report)
    from labkit.report.plan import REPORT_TARGET_S

    only = split_variants(args.only)
    choose_notebooks(find_notebooks(), only)  # an unknown name: one line naming the valid ones
    if args.preset is not None and args.preset not in PRESETS:
        raise ConfigError(f"unknown preset {args.preset!r}; valid: {', '.join(PRESETS)}")
    if args.device is not None:
        resolve_device(args.device)  # an absent device: one line, before anything runs
    if args.jobs is not None and args.jobs < 1:
        raise ConfigError(f"--jobs={args.jobs}: give 1 or more")
    budget_s = _budget_s(args.budget_s, REPORT_TARGET_S)
    overrides = parse_assignments(args.overrides) if args.overrides else {}
    check_settings(list(overrides))  # a setting no experiment takes: exit 2 before anything runs
    options = dict(preset=args.preset, device=args.device, overrides=overrides, runs_dir=args.runs_dir,
                   only=only, jobs=args.jobs, budget_s=budget_s)
    if args.dry_run:
        print(describe_report(run_report(args.out, dry_run=True, **options), budget_s))
        return 0
    writable_folder(args.out, "--out")
    checked_runs_dir(args.runs_dir or Path(args.out) / "runs")
    report = run_report(args.out, progress=sys.stderr.isatty(), **options)
    print(f"report written to {report.out / 'index.html'}: {len(report.notebooks)} notebooks, "
          f"{len(report.failed)} failed, {report.seconds:.0f} s")
    for run in report.failed:
        print(f"labkit: error: {run.stem} failed: {run.error}", file=sys.stderr)
    return 1 if report.failed else 0


def cmd_profile(args: argparse.Namespace) -> int:
    from labkit.harness.experiment import profile_experiment

    writable_file(args.trace, "--trace")
    prof = profile_experiment(args.name, preset=args.preset, variant=args.variant,
                              overrides=_overrides(args), trace_path=args.trace)
    print("\n".join(prof.findings()))
    print(prof.operators.head(args.top).to_string(index=False))
    print(f"Chrome trace: {prof.trace_path}")
    return 0


def lab_command(port: int, token: str, root_dir: str | os.PathLike | None = None
                ) -> tuple[list[str], dict[str, str]]:
    """JupyterLab on the repository's notebooks (or `root_dir`), bound to 127.0.0.1, with `token`
    required (given through JUPYTER_TOKEN, so it is not in the process list); --allow-root only
    where root runs it."""
    from labkit.hardware import REPO_DIR

    notebooks = Path(root_dir) if root_dir else REPO_DIR / "notebooks"
    if not notebooks.is_dir():
        raise ConfigError(f"no notebooks folder at {notebooks}: labkit lab runs from a source checkout")
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port={port}: valid: 1..65535")
    cmd = [sys.executable, "-m", "jupyterlab", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.root_dir={notebooks}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    return cmd, {**os.environ, "JUPYTER_TOKEN": token}


def cmd_lab(args: argparse.Namespace) -> int:
    import secrets
    import shlex
    import subprocess

    token = secrets.token_urlsafe(24)
    cmd, env = lab_command(args.port, token)
    print(f"http://127.0.0.1:{args.port}/lab?token={token}")
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    return subprocess.call(cmd, env=env)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from labkit.views import roofline

    sizes = None
    if args.sizes:
        try:
            sizes = [int(v) for v in args.sizes.split(",")]
        except ValueError:
            raise ConfigError(f"--sizes={args.sizes!r}: give integers, e.g. 256,512,1024") from None
    checked_runs_dir(args.runs_dir)
    print(roofline.summary(roofline.calibrate(args.device or "auto", args.runs_dir, sizes=sizes)))
    return 0


def cmd_selfcheck(args: argparse.Namespace) -> int:
    from labkit.config import resolve_device
    from labkit.harness.selfcheck import chosen_families, exit_code, recheck, selfcheck

    if args.out:
        writable_file(args.out, "--out")
    if args.recheck:
        return exit_code(recheck(args.recheck, args.runs_dir, args.out))
    if args.budget_s is not None and not args.budget_s > 0:
        raise ConfigError(f"--budget-s={args.budget_s:g}: give a number of seconds above 0")
    families = chosen_families(args.family)
    resolve_device(args.device)  # an absent device: one line naming the valid ones
    checked_runs_dir(args.runs_dir)
    return exit_code(selfcheck(args.device, args.budget_s, args.runs_dir, args.out,
                               families=families))


def cmd_plan(args: argparse.Namespace) -> int:
    """A plan that does not fit is an answer (exit 0); only bad input exits 2."""
    from labkit.views.plan import format_plan
    from labkit.planner import plan_report

    model = args.model
    if args.hf_model:
        if args.model:
            raise ConfigError("give --model or --hf-model, not both")
        model = hf_model_config(args.hf_model)
    report = plan_report(model=model, params=args.params, batch_size=args.batch_size,
                         seq_len=args.seq_len, precision=args.precision, optimizer=args.optimizer,
                         optimizer_impl=args.optimizer_impl, zero_stage=args.zero_stage,
                         tp=args.tp, pp=args.pp, gpus=args.gpus, gpu_mem_gib=args.gpu_mem_gib,
                         checkpointing=args.checkpointing, effective_batch=args.effective_batch,
                         finetune=args.finetune, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                         lora_targets=args.lora_targets, ep=args.ep)
    print(json.dumps(report, allow_nan=False) if args.json else format_plan(report))
    return 0


def hf_model_config(folder: str):
    """The shape of a Hugging Face folder (`labkit.blocks.hf`): a bad folder is one line."""
    from labkit.blocks.hf import model_config

    return model_config(folder)


def cmd_train_reference(args: argparse.Namespace) -> int:
    from labkit.blocks.reference import (DEFAULTS, DRAFT_DEFAULTS, QUICK, train_reference,
                                         write_reference)

    name = "draft" if args.draft else "reference"
    defaults = DRAFT_DEFAULTS if args.draft else DEFAULTS
    settings = {**defaults, **(QUICK if args.quick else {}), "seed": args.seed}
    if args.steps is not None:
        if args.steps < 1:
            raise ConfigError(f"--steps {args.steps} must be at least 1")
        settings["steps"] = args.steps
    writable_folder(args.out, "--out")

    def log(step: int, loss: float) -> None:
        if sys.stderr.isatty() and (step % 100 == 0 or step == settings["steps"] - 1):
            print(f"step {step:>5}  loss {loss:.3f}", file=sys.stderr)

    model, stats = train_reference(**settings, log=log, name=name)
    record = write_reference(model, stats, args.out, name)
    print(f"wrote {args.out}/{name}.safetensors  sha256 {record['sha256']}\n"
          f"held-out perplexity {record['heldout_ppl']:.2f} (random init "
          f"{record['random_init_ppl']:.1f}); final loss {record['final_loss']:.3f}; "
          f"{record['steps']} steps in {record['train_s']:.1f} s")
    return 0


COMMANDS = {"env": cmd_env, "list": cmd_list, "run": cmd_run, "results": cmd_results,
            "report": cmd_report, "plan": cmd_plan, "train-reference": cmd_train_reference,
            "calibrate": cmd_calibrate, "profile": cmd_profile, "lab": cmd_lab,
            "selfcheck": cmd_selfcheck}


if __name__ == "__main__":
    sys.exit(main())
