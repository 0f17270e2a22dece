"""The experiment record: everything the harness, CLI, panel, report and notebook generator read
about one experiment, as one typed value built from its module.

An experiment module defines `Config`, `VARIANTS`, `REFERENCE`, `build`, `compare` and `expected`;
it may define `validate`, `skip_reason`, `reference_ignores`, `DISTRIBUTED`, `CPU_RANKS`, `SIZES`
and `CPU_RUNGS`. `from_module` is the only place that reads those names, so no caller probes a
module for optional pieces.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping

from labkit.config import PRESETS, RunConfig

REQUIRED = ("Config", "VARIANTS", "REFERENCE", "build", "compare", "expected")
# Ranks a multi-process experiment starts where there are no GPUs, unless it sets CPU_RANKS.
DEFAULT_CPU_RANKS = 2


@dataclass(frozen=True)
class Experiment:
    """One experiment. `variants` are the lines of its comparison, `reference` among them;
    `validate(cfg)` raises ConfigError for a config it refuses, `skip_reason(cfg)` says why a
    variant cannot run here (None: it can); `reference_ignores(cfg)` names the knobs that the
    reference does not read at `cfg` (a sweep measures it once across points that differ only in
    those; None: every knob counts); `cpu_ranks` is the ranks it starts without GPUs (1
    for a single-process experiment); `sizes` maps a preset to the settings this experiment sets
    there over the preset's own; `cpu_rungs` are cheaper sizes of its default CPU run, each
    cheaper than the one before (`labkit.harness.budget` steps down them on a slow CPU);
    `notebook` is its notebook's path from the repository root."""

    name: str
    module: ModuleType
    Config: type[RunConfig]
    variants: tuple[str, ...]
    reference: str
    build: Callable[[RunConfig], Any]
    compare: Callable[[dict, dict, RunConfig], Any]
    expected: Callable[[RunConfig], dict[str, float]]
    validate: Callable[[RunConfig], None] | None = None
    skip_reason: Callable[[RunConfig], str | None] | None = None
    reference_ignores: Callable[[RunConfig], tuple[str, ...]] | None = None
    distributed: bool = False
    cpu_ranks: int = 1
    sizes: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    cpu_rungs: tuple[Mapping[str, Any], ...] = ()
    notebook: str | None = None

    @property
    def summary(self) -> str:
        """The first line of the module's docstring (what `labkit list` shows)."""
        return ((self.module.__doc__ or "").strip().splitlines() or [""])[0]

    def check(self, cfg: RunConfig) -> None:
        """Raise ConfigError when the experiment refuses `cfg` (nothing when it has no validate)."""
        if self.validate is not None:
            self.validate(cfg)

    def why_skipped(self, cfg: RunConfig) -> str | None:
        """Why `cfg.variant` cannot run here, or None when it can."""
        return None if self.skip_reason is None else self.skip_reason(cfg)


def from_module(name: str, module: ModuleType, notebook: str | None) -> Experiment:
    """The record of experiment `name` from its module; an ImportError naming what is missing or
    wrong when the module does not keep the contract."""
    ns = vars(module)
    missing = [k for k in REQUIRED if k not in ns]
    if missing:
        raise ImportError(f"experiment {name!r} ({module.__name__}) lacks {', '.join(missing)}; "
                          f"an experiment module defines {', '.join(REQUIRED)}")
    distributed = bool(ns.get("DISTRIBUTED", False))
    rec = Experiment(
        name=name, module=module, Config=ns["Config"], variants=tuple(ns["VARIANTS"]),
        reference=ns["REFERENCE"], build=ns["build"], compare=ns["compare"],
        expected=ns["expected"], validate=ns.get("validate"), skip_reason=ns.get("skip_reason"),
        reference_ignores=ns.get("reference_ignores"),
        distributed=distributed,
        cpu_ranks=int(ns.get("CPU_RANKS", DEFAULT_CPU_RANKS if distributed else 1)),
        sizes=ns.get("SIZES", {}), cpu_rungs=tuple(ns.get("CPU_RUNGS", ())), notebook=notebook)
    _check_record(rec)
    return rec


def _check_record(rec: Experiment) -> None:
    where = f"experiment {rec.name!r} ({rec.module.__name__})"
    if rec.reference not in rec.variants:
        raise ImportError(f"{where}: REFERENCE {rec.reference!r} is not one of VARIANTS "
                          f"({', '.join(rec.variants)})")
    unknown = sorted(set(rec.sizes) - set(PRESETS))
    if unknown:
        raise ImportError(f"{where}: SIZES names unknown preset {unknown[0]!r}; valid: "
                          f"{', '.join(PRESETS)}")
    if rec.cpu_ranks < 1 or (rec.cpu_ranks > 1 and not rec.distributed):
        raise ImportError(f"{where}: CPU_RANKS={rec.cpu_ranks}; valid: 1 for a single-process "
                          "experiment, >= 1 with DISTRIBUTED = True")
