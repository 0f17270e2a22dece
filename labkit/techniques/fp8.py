"""FP8 training: the block linears' matmuls on float8 operands, tensorwise or rowwise scales,
checked against the step in the compute dtype.

- `high_precision` (the reference): the plain training step in the compute dtype (`compute`:
  fp32 on a CPU, bf16 on a GPU), AdamW.
- `fp8_tensorwise`: torchao's default recipe: input and weight cast to e4m3, the output gradient
  to e5m2, one scale per tensor (amax -> the format's largest value).
- `fp8_rowwise`: torchao's rowwise recipe: all three in e4m3, one scale per row along each
  matmul's reduction dimension, rounded down to a power of two.
On CUDA with compute capability 8.9+ (and torchao) the variants run torchao's Float8Linear
(`convert_to_float8_training`: torch._scaled_mm on the fp8 tensor cores) and their speed-up over
the reference is measured; elsewhere they run `labkit.blocks.fp8`'s emulation (bitwise torchao's
`emulate=True` numerics, not its speed), the rows say `emulated` = 1 and the speed-up is a
`skipped` row with the reason. Block linears whose dimensions are multiples of 16 are converted
(torch._scaled_mm's constraint); the output head stays in the compute dtype, as torchtitan does.

Measured on the reference model's own tensors (the `reference` preset's trained weights and
held-out text; random weights on `tiny`), captured by hooks on every block linear in one forward
and backward: per layer the amax of its input, weight and output gradient, their scales, the
e4m3 and e5m2 round-trip errors tensorwise and rowwise, the shares that underflow to zero or
saturate (`numerics_table`); predicted beside them: the rounding bound 2^-(m+1) (half an ulp) and
the RMS error of uniform rounding, about 0.196 x 2^-m. Each variant's loss over `steps` steps and
its first step's gradients (the same weights) against the reference's, within a tolerance
computed from the round-trip error measured in the same run (`tolerances`). The bytes of the fp8
copies (a byte an element plus fp32 scales) against the planner's count
(`labkit.planner.float8`).
"""
from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np
import torch

from labkit import hardware, planner
from labkit.blocks import fp8
from labkit.blocks.training import Trainer, global_relative_difference, step_with_gradients
from labkit.config import MODELS, ConfigError, RunConfig, knob, torch_dtype
from labkit.measure.clock import seconds
from labkit.planner import float8 as fp8_plan
from labkit.workload import Comparison, SkipVariant, Workload

VARIANTS = ("high_precision", "fp8_tensorwise", "fp8_rowwise")
REFERENCE = "high_precision"
RECIPE = {"fp8_tensorwise": "tensorwise", "fp8_rowwise": "rowwise"}
SIZES = {"tiny": {"batch_size": 2}}  # 128 tokens: the emulated casts make a CPU step 2-3x the plain one
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"seq_len": 32, "steps": 1}, {"seq_len": 32, "steps": 1, "num_layers": 2})
COMPUTE = {"fp32": "float32", "bf16": "bfloat16"}
KERNELS = ("auto", "emulated")
FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada, Hopper and newer
PAIRED_STEPS = 3  # the reference's step and the variant's, alternately, for the measured speed-up
# The tolerances (`tolerances`): a gradient is a product of cast operands and inherits, through
# every layer above it, the rounding of the output gradient and of the weights there: about
# sqrt(2 L + 1) independent casts of relative error eps each (eps: the largest round-trip
# error of the recipe's operands measured in this run), times GRAD_MARGIN for what that count
# leaves out (the embedding's gradient gathers every layer's; rowwise's power-of-two scales).
# Measured: grad_rel_diff / (sqrt(2L + 1) eps) = 0.31 (reference preset, tensorwise) to 1.54
# (tiny, 1 layer, rowwise), so GRAD_MARGIN = 3 leaves room at every depth tried; a broken cast
# (a scale not divided out) is off by orders of magnitude, and a wrong axis fails the bitwise
# comparison with torchao's emulation (tests/test_fp8.py). The loss is a mean over B x T tokens
# whose errors have random signs: the same bound over sqrt(B x T) (measured 1e-4 to 1e-3 of
# the loss, 14-150x under it).
GRAD_MARGIN = 3.0


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS,
                        help="high-precision step, or fp8 linears with tensorwise / rowwise scales")
    steps: int = knob(2, min=1, help="training steps compared (the gradients: the first step's)")
    lr: float = knob(1e-3, min=0.0, help="AdamW learning rate")
    compute: str = knob("auto", choices=("auto", *COMPUTE), help="compute dtype (auto: bf16 on a GPU, fp32 on a CPU)")
    kernel: str = knob("auto", choices=KERNELS,
                       help="auto: torchao's fp8 matmuls where the GPU has them; emulated: always emulate")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"fp8 chooses its dtype with `compute` (got dtype={cfg.dtype}); "
                          f"valid compute: auto, {', '.join(COMPUTE)}")
    if cfg.preset == "reference" and cfg.model != MODELS["reference"]:
        raise ConfigError("the reference preset loads the trained model; its shape cannot be set")
    if cfg.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"seq_len={cfg.seq_len} is past the model's context ({cfg.model.max_seq_len})")


def skip_reason(cfg: Config) -> str | None:
    if cfg.compute == "bf16" and cfg.device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        return "compute=bf16 on a GPU without bf16 (compute capability 8.0 or newer needed)"
    return None


def compute_dtype(cfg: Config) -> str:
    """float32 or bfloat16: `compute`, or where auto, bf16 on a GPU that has it, else fp32 (a
    CPU's bf16 matmuls are slow or emulated, and fp32 is the cleaner reference)."""
    gpu_bf16 = cfg.device.startswith("cuda") and torch.cuda.is_bf16_supported()
    return COMPUTE[cfg.compute if cfg.compute != "auto" else "bf16" if gpu_bf16 else "fp32"]


def emulation_reason(cfg: Config) -> str | None:
    """Why the fp8 variants emulate here (None: torchao's float8 linear runs for real)."""
    if cfg.kernel == "emulated":
        return "kernel=emulated"
    if not cfg.device.startswith("cuda"):
        return "a CPU has no fp8 matmul"
    cc = torch.cuda.get_device_capability(cfg.device)
    if cc < FP8_CAPABILITY:
        return (f"compute capability {cc[0]}.{cc[1]}: fp8 tensor cores need "
                f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} (Ada, Hopper) or newer")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "torchao is not installed (pip install labkit[finetune])"
    return None


# --- the step ---------------------------------------------------------------------------------------

def base_model(cfg: Config, dtype: torch.dtype) -> torch.nn.Module | None:
    """The trained model on the `reference` preset (a skip when its weights are missing), else
    None (the Trainer's seeded one)."""
    if cfg.preset != "reference":
        return None
    from labkit.blocks import reference

    try:
        return reference.load_reference(device=cfg.device, dtype=dtype).train()
    except ConfigError as e:
        raise SkipVariant(str(e)) from e


def fp8_step(cfg: Config, variant: str | None = None) -> tuple[Trainer, list[str]]:
    """The variant's training step and the names of its float8 linears. Order: the model in the
    compute dtype (on `reference` the trained one, on its held-out text), then the float8
    converter (before the optimizer, which then holds the same weights), then AdamW."""
    variant = variant or cfg.variant
    dtype = torch_dtype(compute_dtype(cfg))
    trainer = Trainer(cfg, weights=dtype, lr=cfg.lr, optimizer=False, model=base_model(cfg, dtype))
    if cfg.preset == "reference":
        from labkit.blocks import reference

        text = reference.heldout(cfg.batch_size, cfg.seq_len + 1).to(cfg.device)
        trainer.inputs, trainer.targets = text[:, :-1], text[:, 1:]
    names = []
    if variant != REFERENCE:
        names = fp8.apply_float8(trainer.model, RECIPE[variant], emulate=emulation_reason(cfg) is not None)
    trainer.build_optimizer()
    return trainer, names


# --- the numerics, on the reference model's tensors -----------------------------------------------

def capture(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """One forward and backward of the trainer's batch, each block linear's operands captured
    (`fp8.capture_linears`); the gradients dropped after."""
    seen = fp8.capture_linears(trainer.model, lambda: trainer.forward().backward())
    trainer.drop_grads()
    return seen


def numerics_table(cfg: Config):
    """A DataFrame, one row per block linear x role (input, weight, grad_output) x format (e4m3,
    e5m2) x granularity (tensorwise, rowwise: a scale per row, power-of-two as torchao's
    rowwise): amax, scale (rowwise: the smallest, and scale_max), the round trip's rel_error,
    max_rel_error, underflow and saturated fractions, the number of values. Measured on the
    reference (high-precision) step's tensors; computed once per process for a configuration."""
    return _numerics(cfg.preset, cfg.model, cfg.batch_size, cfg.seq_len, cfg.seed, cfg.device,
                     compute_dtype(cfg), cfg.attention).copy()


@functools.lru_cache(maxsize=2)
def _numerics(preset, model, batch_size, seq_len, seed, device, dtype, attention):
    import pandas as pd

    cfg = Config(preset=preset, model=model, batch_size=batch_size, seq_len=seq_len, seed=seed,
                 device=device, compute=next(k for k, v in COMPUTE.items() if v == dtype),
                 attention=attention)
    trainer, _ = fp8_step(cfg, REFERENCE)
    rows = []
    for i, (name, tensors) in enumerate(capture(trainer).items()):
        for role, x in tensors.items():
            for fmt in fp8.FORMATS:
                for gran in fp8.GRANULARITIES:
                    stats = fp8.round_trip_stats(x, fmt, fp8.row_dim(gran), power_of_2=gran == "rowwise")
                    rows.append({"index": i, "linear": name, "layer": int(name.split(".")[1]),
                                 "kind": name.rsplit(".", 1)[-1], "role": role, "format": fmt,
                                 "granularity": gran, **stats, "numel": x.numel()})
    return pd.DataFrame(rows)


def recipe_rows(table, recipe: fp8.Recipe):
    """The table's rows that a recipe casts: each role in its format at its granularity."""
    keep = np.zeros(len(table), dtype=bool)
    for role, fmt in recipe.formats.items():
        keep |= ((table["role"] == role) & (table["format"] == fmt)
                 & (table["granularity"] == recipe.granularity)).to_numpy()
    return table[keep]


def pooled(rows, column: str) -> float:
    """A fraction over many tensors, weighted by their sizes."""
    return float((rows[column] * rows["numel"]).sum() / rows["numel"].sum())


def recipe_numerics(table, recipe: fp8.Recipe) -> dict[str, float]:
    """The variant's rows: each role's worst round-trip error over the layers, the largest
    elementwise error, the pooled underflow and saturated shares."""
    rows = recipe_rows(table, recipe)
    out = {f"{role}_rel_error": float(rows[rows.role == role]["rel_error"].max()) for role in fp8.ROLES}
    out.update(max_rel_error=float(rows["max_rel_error"].max()),
               underflow_fraction=pooled(rows, "underflow_fraction"),
               saturated_fraction=pooled(rows, "saturated_fraction"))
    return out


def format_numerics(table) -> dict[str, float]:
    """The reference's rows: what e4m3 and e5m2 do to its tensors, tensorwise: the activations'
    worst round-trip error, the largest elementwise error, the output gradients' underflow."""
    out = {}
    for fmt in fp8.FORMATS:
        rows = table[(table.format == fmt) & (table.granularity == "tensorwise")]
        out[f"{fmt}_rel_error"] = float(rows[rows.role == "input"]["rel_error"].max())
        out[f"{fmt}_max_rel_error"] = float(rows["max_rel_error"].max())
        out[f"{fmt}_grad_underflow_fraction"] = pooled(rows[rows.role == "grad_output"], "underflow_fraction")
    return out


def tolerances(cfg: Config, numerics: dict[str, float]) -> dict[str, float]:
    """Relative limits on the gradients and the loss from the round-trip error eps measured in
    this run (the worst of the recipe's three operands): GRAD_MARGIN x sqrt(2L + 1) x eps, and
    that over sqrt(B x T) for the loss (see GRAD_MARGIN)."""
    eps = max(numerics[f"{role}_rel_error"] for role in fp8.ROLES)
    grad = GRAD_MARGIN * math.sqrt(2 * cfg.model.num_layers + 1) * eps
    return {"grad": grad, "loss": grad / math.sqrt(cfg.batch_size * cfg.seq_len)}


# --- the experiment ---------------------------------------------------------------------------------

def build(cfg: Config) -> Workload:
    trainer, names = fp8_step(cfg)
    recipe = fp8.RECIPES.get(RECIPE.get(cfg.variant, ""))

    def check() -> dict:
        out = step_with_gradients(trainer)  # the first step's gradients: the same weights for all
        out["losses"] = [out["loss"], *(trainer.step() for _ in range(cfg.steps - 1))]
        table = numerics_table(cfg)
        out["numerics"] = format_numerics(table) if recipe is None else recipe_numerics(table, recipe)
        return out

    def report() -> dict[str, float]:
        out = {"fp8_linears": len(names)}
        if recipe is not None:
            out.update(fp8_bytes(cfg, trainer, names, recipe), emulated=float(emulation_reason(cfg) is not None))
            if emulation_reason(cfg) is None:
                out["speedup"] = speedup(cfg, trainer)
        return out

    skipped = {}
    if recipe is not None and emulation_reason(cfg):
        skipped["speedup"] = (f"not measured: the fp8 linears are emulated here ({emulation_reason(cfg)}); "
                              "emulation costs casts on top of an fp32 matmul, so its time says nothing "
                              "about fp8's speed")
    return Workload(
        step=trainer.step, check=check, tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": trainer.model.parameters, "optimizer_bytes": trainer.optimizer_tensors},
        forward=trainer.forward, resident=trainer.model.parameters, report=report,
        notes=notes(cfg), compute_dtype=compute_dtype(cfg), skipped=skipped)


def fp8_bytes(cfg: Config, trainer: Trainer, names: list[str], recipe: fp8.Recipe) -> dict[str, int]:
    """Bytes of the forward's float8 copies of the converted linears' weights and inputs (data
    and scales), measured from the tensors the casts make on the step's own inputs."""
    seen = capture(trainer)
    total = {"fp8_weight_bytes": 0, "fp8_input_bytes": 0}
    for name in names:
        cast = fp8.cast_bytes(seen[name]["weight"], seen[name]["input"], recipe)
        total["fp8_weight_bytes"] += cast["weight"]
        total["fp8_input_bytes"] += cast["input"]
    return total


def speedup(cfg: Config, trainer: Trainer) -> float:
    """The reference step's time over this variant's (the same seeded weights and batch),
    PAIRED_STEPS of each alternately, medians."""
    plain, _ = fp8_step(cfg, REFERENCE)
    times: dict[str, list[float]] = {"plain": [], "mine": []}
    for _ in range(PAIRED_STEPS):
        times["plain"].append(seconds(plain.step, cfg.device))
        times["mine"].append(seconds(trainer.step, cfg.device))
    return statistics.median(times["plain"]) / statistics.median(times["mine"])


# --- the check -----------------------------------------------------------------------------------------

def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Within `tolerances`: the first step's gradients (normwise over the whole model) and the
    loss at every step, relative to the reference's; and every cast within its format's
    rounding bound, nothing saturated (a broken scale fails these first). The reference against
    itself: zero deltas and its format numerics."""
    ref, got = np.array(reference["losses"]), np.array(outputs["losses"])
    numerics = outputs["numerics"]
    metrics = {"loss": outputs["loss"], "loss_delta": float(got[-1] - ref[-1]),
               "loss_rel_diff": float(np.max(np.abs(got - ref) / np.abs(ref))),
               "grad_rel_diff": global_relative_difference(reference["grads"], outputs["grads"]),
               **numerics}
    if cfg.variant == REFERENCE:
        finite = bool(np.isfinite(ref).all())
        return Comparison(metrics, finite, "" if finite else "a loss is not finite")
    limit = tolerances(cfg, numerics)
    bound = max(map(fp8.rounding_bound, fp8.RECIPES[RECIPE[cfg.variant]].formats.values()))
    failed = [what for what, bad in (
        (f"gradients {metrics['grad_rel_diff']:.3g} from the reference's (> {limit['grad']:.3g})",
         not metrics["grad_rel_diff"] <= limit["grad"]),
        (f"loss {metrics['loss_rel_diff']:.3g} from the reference's (> {limit['loss']:.3g})",
         not metrics["loss_rel_diff"] <= limit["loss"]),
        (f"a cast's error {numerics['max_rel_error']:.3g} past the rounding bound {bound:g}",
         not numerics["max_rel_error"] <= bound * (1 + 1e-6)),
        (f"{numerics['saturated_fraction']:.2%} saturated", numerics["saturated_fraction"] > 0)) if bad]
    return Comparison({**metrics, "grad_tolerance": limit["grad"], "loss_tolerance": limit["loss"]},
                      not failed, "; ".join(failed))


# --- the napkin math --------------------------------------------------------------------------------

def expected(cfg: Config) -> dict[str, float]:
    m, tokens = cfg.model, cfg.batch_size * cfg.seq_len
    out: dict[str, float] = {"fp8_linears": 0 if cfg.variant == REFERENCE else len(fp8_plan.float8_shapes(m)),
                             "flops": planner.train_step_flops(m, batch=cfg.batch_size, seq_len=cfg.seq_len,
                                                               attention=cfg.attention)}
    if cfg.variant == REFERENCE:
        for fmt in fp8.FORMATS:
            out[f"{fmt}_rel_error"] = fp8.rms_rounding_error(fmt)
            out[f"{fmt}_max_rel_error"] = fp8.rounding_bound(fmt)
        out.update(loss_delta=0.0, grad_rel_diff=0.0)
        return out
    recipe = fp8.RECIPES[RECIPE[cfg.variant]]
    cast = fp8_plan.float8_cast_bytes(m, tokens=tokens, granularity=recipe.granularity)
    out.update({f"{role}_rel_error": fp8.rms_rounding_error(fmt) for role, fmt in recipe.formats.items()})
    out.update(max_rel_error=max(map(fp8.rounding_bound, recipe.formats.values())), saturated_fraction=0.0,
               fp8_weight_bytes=cast["weight"], fp8_input_bytes=cast["input"],
               emulated=float(emulation_reason(cfg) is not None))
    peaks = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads)
    if peaks.get("float8") and peaks.get(compute_dtype(cfg)):
        out["speedup"] = fp8_plan.float8_speedup_bound(m, batch=cfg.batch_size, seq_len=cfg.seq_len,
                                                       rate_ratio=peaks["float8"] / peaks[compute_dtype(cfg)],
                                                       attention=cfg.attention)
    return out


def notes(cfg: Config) -> dict[str, str]:
    dtype, why = compute_dtype(cfg), emulation_reason(cfg)
    out = {"loss": f"compute dtype {dtype}; {cfg.steps} steps on one batch"
                   + (" of the reference language's held-out text" if cfg.preset == "reference" else ""),
           "grad_rel_diff": "||g - g_ref|| / ||g_ref|| over every gradient of the first step (the same "
                            "weights); checked against grad_tolerance, from the round-trip error measured here.",
           "loss_rel_diff": "the largest |loss - reference| / reference over the steps; checked against "
                            "loss_tolerance."}
    if cfg.variant == REFERENCE:
        out["e4m3_rel_error"] = ("the block linears' inputs through e4m3 and back, tensorwise, worst layer "
                                 "(||x' - x|| / ||x||); predicted: uniform rounding, 0.196 x 2^-3.")
        out["e4m3_max_rel_error"] = ("largest |x' - x| / |x| over every normal value of inputs, weights and "
                                     "output gradients; predicted: the bound, half an ulp = 2^-4.")
        out["e4m3_grad_underflow_fraction"] = ("output gradients that e4m3 rounds to zero, tensorwise: why "
                                               "torchao's tensorwise recipe casts them to e5m2.")
        return out
    out["emulated"] = ("0: torchao's Float8Linear (torch._scaled_mm)" if why is None else
                       f"1: the numerics of torchao's float8 linear emulated in plain PyTorch ({why}); "
                       "not its speed")
    out["fp8_weight_bytes"] = ("the converted weights' fp8 copies as the casts made them; predicted: "
                               "N K bytes + 4 bytes per scale (one per tensor, or per output row).")
    out["fp8_input_bytes"] = ("the converted linears' inputs in fp8 (tokens x K bytes + 4 per scale, one "
                              "per tensor or per token); the backward casts x and W again along the "
                              "other axis (torchao saves them in high precision).")
    out["speedup"] = ("the reference step's time / this one's, timed alternately; predicted: Amdahl "
                      "with only the fp8 linears' matmuls at the fp8 / 16-bit peak ratio, a bound.")
    return out


# --- rowwise against tensorwise on an outlier row --------------------------------------------------

def outlier_rows(cfg: Config, factor: float = 1e4, fmt: str = "e4m3"):
    """A DataFrame: the first block linear's captured input with its first row scaled by
    `factor` (one outlier token, as LLMs' massive activations are), through `fmt` tensorwise and
    rowwise: the round-trip error of the outlier row and of the other rows, and the share of the
    other rows' values rounded to zero. One tensorwise scale fits the outlier and pushes the
    other rows down towards the subnormals; rowwise scales each row by its own amax."""
    import pandas as pd

    trainer, _ = fp8_step(cfg, REFERENCE)
    x = next(iter(capture(trainer).values()))["input"].float().clone()
    x[0] *= factor
    rows = []
    for gran in fp8.GRANULARITIES:
        back = fp8.round_trip(x, fmt, fp8.row_dim(gran), power_of_2=gran == "rowwise")
        rest, got = x[1:], back[1:]
        rows.append({"granularity": gran,
                     "outlier_row_rel_error": float((back[0] - x[0]).norm() / x[0].norm()),
                     "other_rows_rel_error": float((got - rest).norm() / rest.norm()),
                     "other_rows_underflow_fraction": float(((got == 0) & (rest != 0)).sum() / (rest != 0).sum())})
    return pd.DataFrame(rows).set_index("granularity")

