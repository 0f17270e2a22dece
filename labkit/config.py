"""Typed configuration: model shapes, presets, run settings, and the one `resolve()`.

Every entry point (CLI, widgets, papermill, tests) builds its config through `resolve()`, so a
bad value is refused the same way everywhere: one `ConfigError` line naming the valid choices.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from labkit import hardware


class ConfigError(ValueError):
    """A bad name or value; the message is one line that names the valid choices."""


DTYPE_ALIASES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def knob(default: Any, *, help: str = "", min: float | None = None, max: float | None = None,
         choices: tuple | None = None) -> Any:
    """A dataclass field with its help text and valid range (read by resolve() and the widgets)."""
    meta = {"help": help, "min": min, "max": max, "choices": choices}
    return field(default=default, metadata=meta)


# A participant's or team's name: short and printable (it is shown in tables and stored in runs).
NAME_RE = re.compile(r"[\w .@'-]{0,40}")


def name_knob(env_var: str, *, help: str) -> Any:
    """A name field whose default is read from `env_var` (empty when unset) each time a config
    is made, so `LABKIT_PARTICIPANT=ana labkit run ...` names every run of that shell."""
    return field(default_factory=lambda: os.environ.get(env_var, "").strip(),
                 metadata={"help": f"{help} (default: ${env_var})", "name": True})


def check_name(name: str, value: str) -> str:
    """`value` if it is a short printable name, else one ConfigError line saying what is valid."""
    if not NAME_RE.fullmatch(value):
        raise ConfigError(f"{name}={value[:60]!r} is not a valid name; valid: up to 40 letters, "
                          "digits, spaces and . _ - @ '")
    return value


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The shape of one decoder (Llama-style or GPT-2-style)."""

    arch: str = knob("llama", choices=("llama", "gpt2"), help="block style")
    num_layers: int = knob(4, min=1, help="transformer blocks")
    hidden_size: int = knob(256, min=8, help="model width")
    num_heads: int = knob(4, min=1, help="query heads")
    num_kv_heads: int = knob(2, min=1, help="key/value heads (grouped-query attention)")
    ffn_size: int = knob(688, min=1, help="MLP inner width")
    vocab_size: int = knob(4096, min=2, help="vocabulary")
    max_seq_len: int = knob(2048, min=1, help="context length")
    rope_theta: float = knob(10000.0, min=1.0, help="RoPE base (llama)")
    norm_eps: float = knob(1e-5, min=0.0, help="norm epsilon")
    tie_embeddings: bool = knob(False, help="share input and output embeddings")
    qkv_bias: bool = knob(False, help="biases on the q, k and v projections (Qwen2; gpt2 has all)")
    # Mixture of experts (labkit.blocks.moe; Llama-style only): every block's MLP becomes a
    # router and num_experts SwiGLU experts. 0 experts: the dense MLP above, nothing else changes.
    num_experts: int = knob(0, min=0, help="experts per MoE layer (0: the dense MLP)")
    experts_per_token: int = knob(2, min=1, help="k of top-k: the experts each token is sent to")
    moe_ffn_size: int = knob(0, min=0, help="each expert's inner width (0: ffn_size)")
    shared_expert_ffn_size: int = knob(0, min=0, help="inner width of a shared expert every token "
                                       "passes, gated by a sigmoid (Qwen2-MoE); 0: none")
    capacity_factor: float = knob(0.0, min=0.0, help="expert capacity = ceil(factor x tokens x k "
                                  "/ experts) per group of tokens, the rest dropped; 0: no limit")
    router_aux_loss_coef: float = knob(0.01, min=0.0, help="weight of the load-balancing loss "
                                       "added to the training loss")
    norm_topk_prob: bool = knob(True, help="renormalise the top-k router weights to sum to 1 "
                                "(Mixtral; Qwen2-MoE's norm_topk_prob)")
    # Read from a Hugging Face config.json (labkit.blocks.hf), never set with --set:
    # Llama 3's RoPE scaling (factor, low_freq_factor, high_freq_factor, original context) ...
    rope_llama3: tuple[float, float, float, int] | None = field(default=None,
                                                                 metadata={"internal": True})
    # ... and the folder the shape came from: build_model loads its safetensors weights while
    # the shape is the folder's own (not shrunk with --set).
    source: str = field(default="", metadata={"internal": True})

    def __post_init__(self):
        if isinstance(self.rope_llama3, list):  # a stored run's params (JSON has no tuples)
            object.__setattr__(self, "rope_llama3", tuple(self.rope_llama3))

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def expert_ffn_size(self) -> int:
        """Each expert's inner width (moe_ffn_size, or ffn_size when that is 0)."""
        return self.moe_ffn_size or self.ffn_size


def _llama(**kw: Any) -> ModelConfig:
    return ModelConfig(arch="llama", **kw)


# Published shapes (config.json of each release); the tests check the parameter counts.
MODELS: dict[str, ModelConfig] = {
    "tiny": _llama(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, ffn_size=688,
                   vocab_size=4096, max_seq_len=2048),
    "small": _llama(num_layers=12, hidden_size=768, num_heads=12, num_kv_heads=4, ffn_size=2048,
                    vocab_size=32000, max_seq_len=4096),
    "medium": _llama(num_layers=16, hidden_size=2048, num_heads=16, num_kv_heads=8, ffn_size=5632,
                     vocab_size=32000, max_seq_len=4096),
    # The model labkit trains itself (`labkit train-reference`; weights in data/reference/): small
    # enough to ship, trained on a seeded synthetic language, so quality deltas mean something.
    "reference": _llama(num_layers=4, hidden_size=128, num_heads=4, num_kv_heads=2, ffn_size=344,
                        vocab_size=512, max_seq_len=1024),
    "gpt2-124m": ModelConfig(arch="gpt2", num_layers=12, hidden_size=768, num_heads=12,
                             num_kv_heads=12, ffn_size=3072, vocab_size=50257, max_seq_len=1024,
                             tie_embeddings=True),
    "llama-2-7b": _llama(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=32,
                         ffn_size=11008, vocab_size=32000, max_seq_len=4096),
    "llama-3-8b": _llama(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                         ffn_size=14336, vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama-3-70b": _llama(num_layers=80, hidden_size=8192, num_heads=64, num_kv_heads=8,
                          ffn_size=28672, vocab_size=128256, max_seq_len=8192,
                          rope_theta=500000.0),
    "mistral-7b": _llama(num_layers=32, hidden_size=4096, num_heads=32, num_kv_heads=8,
                         ffn_size=14336, vocab_size=32000, max_seq_len=32768),
}

# Default run sizes per preset, the same for every experiment. An experiment's own sizes per preset
# (and, where it needs one, model-shape fields) live in its module's SIZES, next to the reason,
# and reach resolve() through its record.
PRESET_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"batch_size": 4, "seq_len": 64},
    "reference": {"batch_size": 8, "seq_len": 128},
    "small": {"batch_size": 8, "seq_len": 512},
    "medium": {"batch_size": 8, "seq_len": 1024},
    "gpt2-124m": {"batch_size": 8, "seq_len": 1024},
    "llama-2-7b": {"batch_size": 1, "seq_len": 2048},
    "llama-3-8b": {"batch_size": 1, "seq_len": 2048},
    "llama-3-70b": {"batch_size": 1, "seq_len": 2048},
    "mistral-7b": {"batch_size": 1, "seq_len": 2048},
}
PRESETS = tuple(MODELS)
# A GPU with at least this much memory gets the `medium` preset by default, else `small`.
MEDIUM_PRESET_MIN_BYTES = 40 * 2**30


def default_preset(device: str) -> str:
    """`tiny` on the CPU; on a GPU a size chosen from its memory."""
    if not device.startswith("cuda"):
        return "tiny"
    gpus = hardware.gpu_info()
    index = int(device.split(":")[1]) if ":" in device else 0
    memory = gpus[index].memory_total_bytes if index < len(gpus) else 0
    return "medium" if memory >= MEDIUM_PRESET_MIN_BYTES else "small"


@dataclass(kw_only=True)
class RunConfig:
    """Settings every experiment shares; each experiment subclasses it with its own knobs."""

    variant: str = knob("", help="the line in the plot")
    preset: str = knob("tiny", choices=PRESETS, help="model shape and default sizes")
    device: str = knob("auto", help="auto, cpu, cuda or cuda:N")
    dtype: str = knob("float32", choices=tuple(DTYPE_ALIASES), help="model dtype")
    attention: str = knob("sdpa", choices=("sdpa", "naive"), help="attention implementation")
    batch_size: int = knob(1, min=1, help="sequences per step")
    seq_len: int = knob(64, min=1, help="tokens per sequence")
    num_threads: int = knob(1, min=1, help="CPU intra-op threads while timing (at most the CPU "
                            "threads this process may use)")
    seed: int = knob(0, min=0, help="seed for weights and data")
    memory_budget_gib: float | None = knob(None, min=0.001,
                                           help="virtual memory budget: OOM past it")
    warmup: int = knob(1, min=0, help="untimed calls before timing")
    min_run_time_s: float = knob(0.5, min=0.0, help="timing: least total time measured")
    min_repeats: int = knob(0, min=0, help="timing: least calls timed, step_ms their median (0: "
                            "the experiment's own, 3; 1 where one step is a long run)")
    # Who ran it (a workshop's leaderboard): stored in every row's params; checked by resolve().
    participant: str = name_knob("LABKIT_PARTICIPANT", help="your name on the leaderboard")
    team: str = name_knob("LABKIT_TEAM", help="your team on the leaderboard")
    # Why the defaults were sized down for this CPU (labkit.harness.budget), stored with every row;
    # set by the sizing, not by hand.
    sizing: str = field(default="", metadata={"internal": True, "help": "how the sizes were chosen"})
    model: ModelConfig | None = None
    uses_seq_len: typing.ClassVar[bool] = True  # False where an experiment never reads seq_len

    def params(self) -> dict[str, Any]:
        """The resolved config as a JSON-safe dict (what result rows store)."""
        return dataclasses.asdict(self)


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    """The settable fields: not the model, nor what only a config.json sets (`internal`)."""
    return {f.name: f for f in dataclasses.fields(cls)
            if f.name != "model" and not f.metadata.get("internal")}


def _coerce(name: str, value: Any, hint: Any) -> Any:
    """Turn a CLI string or a widget value into the field's type, or raise ConfigError."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if args else hint
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", ""))):
        return None
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
            return int(value)
    elif base is float and not isinstance(value, bool):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is not None and math.isfinite(number):
            return number
        if number is not None:
            raise ConfigError(f"{name}={value!r} must be a finite number")
    elif base is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{name}={value!r} is not a valid {getattr(base, '__name__', base)}")


def check_choice(name: str, value: Any, choices: typing.Sequence[Any]) -> Any:
    """`value` if it is one of `choices`, else a ConfigError naming them."""
    if value not in choices:
        raise ConfigError(f"unknown {name} {value!r}; valid: {', '.join(map(str, choices))}")
    return value


def _check_range(name: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    choices, lo, hi = meta.get("choices"), meta.get("min"), meta.get("max")
    if choices:
        check_choice(name, value, choices)
    if value is None or isinstance(value, (str, bool)):
        return
    if lo is not None and value < lo:
        raise ConfigError(f"{name}={value} is out of range; it must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{name}={value} is out of range; it must be <= {hi}")


def usable_threads() -> int:
    """The CPU threads this process may run on: its affinity mask where the OS has one (a
    container or `taskset` may allow fewer than the machine has), else os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(name: str, value: int) -> int:
    """`value` if it is 1..usable_threads(), else one ConfigError line naming that range: given
    far more threads than exist, torch.set_num_threads can crash the process (a segfault)."""
    limit = usable_threads()
    if not 1 <= value <= limit:
        raise ConfigError(f"{name}={value} is out of range; valid: 1..{limit} (the CPU threads "
                          "this process may use)")
    return value


def resolve_device(name: str) -> str:
    """`auto` -> the default device; refuse unknown or absent devices with the valid choices."""
    present = hardware.available_devices()
    if name == "auto":
        return hardware.default_device()
    if name == "cpu" or name in present:
        return name
    known = name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit())
    if not known:
        raise ConfigError(f"unknown device {name!r}; valid: auto, {', '.join(present)}"
                          + ("" if "cuda" in present else ", cuda (when a GPU is present)"))
    raise ConfigError(f"device {name!r} is not present here; available: {', '.join(present)}")


def _apply(obj: Any, values: dict[str, Any]) -> Any:
    """dataclasses.replace with each value coerced and range-checked."""
    hints, fields = _hints(type(obj)), _fields(type(obj))
    clean = {}
    for name, value in values.items():
        value = _coerce(name, value, hints[name])
        _check_range(name, value, fields[name].metadata)
        clean[name] = value
    return dataclasses.replace(obj, **clean)


def _check_model(m: ModelConfig) -> None:
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"hidden_size={m.hidden_size} must be a multiple of num_heads={m.num_heads}")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(f"num_heads={m.num_heads} must be a multiple of num_kv_heads={m.num_kv_heads}")
    if m.arch == "gpt2" and m.num_kv_heads != m.num_heads:
        raise ConfigError("gpt2-style models have num_kv_heads == num_heads")
    if m.num_experts and m.arch != "llama":
        raise ConfigError("num_experts: mixture-of-experts layers are Llama-style (SwiGLU experts); "
                          "valid: arch=llama, or num_experts=0")
    if m.num_experts and m.experts_per_token > m.num_experts:
        raise ConfigError(f"experts_per_token={m.experts_per_token} is more than num_experts="
                          f"{m.num_experts}; valid: 1 to {m.num_experts}")


def _check_lengths(cfg: RunConfig) -> None:
    ctx = cfg.model.max_seq_len
    total = getattr(cfg, "prompt_len", 0) + getattr(cfg, "new_tokens", 0)
    if cfg.uses_seq_len and cfg.seq_len > ctx:
        raise ConfigError(f"seq_len={cfg.seq_len} is longer than the model's context ({ctx})")
    if total > ctx:
        raise ConfigError(f"prompt_len + new_tokens = {total} is longer than the model's "
                          f"context ({ctx})")


# Each experiment's own sizes per preset live in its module (`SIZES`, read through its record).
# `labkit.techniques` registers the lookup here when it is imported (any experiment's Config
# imports it first): config sits below the techniques and never imports them.
_size_lookup: Callable[[str, str], dict[str, Any]] | None = None


def register_sizes(lookup: Callable[[str, str], dict[str, Any]]) -> None:
    """Set the function that gives an experiment's sizes at a preset (`labkit.techniques`)."""
    global _size_lookup
    _size_lookup = lookup


def experiment_sizes(experiment: str, preset: str) -> dict[str, Any]:
    """The sizes `experiment` sets at `preset`; none for an empty or unregistered name."""
    return dict(_size_lookup(experiment, preset)) if experiment and _size_lookup else {}


def resolve(config_cls: type[RunConfig], preset: str | None = None,
            overrides: dict[str, Any] | None = None, *, experiment: str = "") -> RunConfig:
    """Build and validate one experiment config.

    Order: the class defaults, then the preset's sizes (and this `experiment`'s own at that
    preset: experiment_sizes), then `overrides`. Overrides may name run fields or model-shape fields; values
    may be strings (from the command line) or typed values (widgets, papermill). `model`, a
    ModelConfig (e.g. `labkit.blocks.hf.model_config(DIR)`), replaces the preset's shape; the
    preset still gives the sizes, and model-shape overrides apply on top of it.
    """
    overrides = dict(overrides or {})
    base = overrides.pop("model", None)
    if base is not None and not isinstance(base, ModelConfig):
        raise ConfigError(f"model={base!r} must be a ModelConfig (labkit.blocks.hf.model_config(DIR) "
                          "reads one from a Hugging Face folder)")
    run_names, model_names = set(_fields(config_cls)), set(_fields(ModelConfig))
    unknown = sorted(set(overrides) - run_names - model_names)
    if unknown:
        valid = ", ".join(sorted(run_names | model_names))
        raise ConfigError(f"unknown setting {unknown[0]!r}{' for ' + experiment if experiment else ''}; "
                          f"valid: {valid}")
    device = resolve_device(str(overrides.pop("device", "auto")))
    preset = preset or overrides.pop("preset", None) or default_preset(device)
    overrides.pop("preset", None)
    _check_range("preset", preset, {"choices": PRESETS})
    sizes = {**PRESET_SIZES[preset], **experiment_sizes(experiment, preset)}
    run_values = {k: v for k, v in {**sizes, **overrides}.items() if k in run_names}
    model = _apply(base or MODELS[preset], {k: v for k, v in {**sizes, **overrides}.items() if k in model_names})
    _check_model(model)
    cfg = _apply(config_cls(), run_values)
    cfg = dataclasses.replace(cfg, preset=preset, device=device, model=model,
                              dtype=DTYPE_ALIASES[cfg.dtype])
    _check_lengths(cfg)
    check_threads("num_threads", cfg.num_threads)
    for f in dataclasses.fields(cfg):  # names from overrides and from the environment
        if f.metadata.get("name"):
            check_name(f.name, getattr(cfg, f.name))
    return cfg


def parse_assignments(items: list[str]) -> dict[str, str]:
    """`["a=1", "b=x"]` -> {"a": "1", "b": "x"}; a malformed item is a ConfigError."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_sweep(items: list[str]) -> dict[str, list[str]]:
    """`["batch_size=1,2,4"]` -> {"batch_size": ["1", "2", "4"]} (the CLI's and the panel's)."""
    return {k: [v for v in vs.split(",") if v] for k, vs in parse_assignments(items).items()}


# A sweep: a grid ({knob: values}, every combination) or a list of points ({knob: value} each)
Sweep = dict[str, list[Any]] | list[dict[str, Any]]


def expand_sweep(sweep: Sweep) -> list[dict[str, Any]]:
    """The points of a sweep, in order, as override dicts: the cartesian product of a grid
    ({knob: values}), or a list of points as they are (knobs that change together, as a ladder's
    rungs do: no point measured that nothing reads)."""
    if isinstance(sweep, list):
        if not all(isinstance(point, dict) for point in sweep):
            raise ConfigError(f"a sweep given as a list holds points ({{knob: value}} each); got {sweep!r}")
        return [dict(point) for point in sweep] or [{}]
    if not sweep:
        return [{}]
    keys = list(sweep)
    for key in keys:
        if not sweep[key]:
            raise ConfigError(f"sweep {key} has no values")
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweep[k] for k in keys))]


def sweep_knobs(sweep: Sweep | None) -> set[str]:
    """The knobs a sweep (a grid or a list of points) sets."""
    return {k for point in sweep for k in point} if isinstance(sweep, list) else set(sweep or {})


def torch_dtype(name: str):
    """The torch dtype for a canonical dtype name."""
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
        DTYPE_ALIASES[name]]
