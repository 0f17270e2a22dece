"""Weight-only quantization: the linears' weights stored in fewer bits, activations unchanged.

- `none` (the reference): the model's dtype.
- `int8`: one byte per weight, a 16-bit scale per output channel (gpt-fast's int8).
- `int4`: half a byte per weight, a 16-bit scale and zero point per `group_size` inputs
  (gpt-fast's and torchao's int4); a row not a multiple of the group ends in a shorter group.
- `fp8`: float8_e4m3fn with a scale per output channel (GPUs with compute capability 8.9+).
- `gptq_int4`, `awq_int4`: int4 group `group_size` in int4's storage, rounded by GPTQ (error
  feedback through the inverse Hessian) or after AWQ's activation-aware scaling, calibrated on
  `calib_sequences` x `calib_len` tokens of other text than the one measured (`calibration_text`).
- `w8a8`, `smoothquant_w8a8`: int8's weight storage and int8 activations per token, computed at
  run time; SmoothQuant first moves the activations' outliers into the weights.
  (`labkit.blocks.calibrated`, with the papers.)
Every block linear and the output head are quantized; the embedding and the norms stay.
Decoding is bound by reading the weights once per token, so fewer bytes can mean more tokens/s,
if the kernel reads the packed bytes (`kernel=packed`, torch's int8/int4 kernels) rather than
dequantizing the whole weight first (`kernel=dequant`, plain PyTorch: more bytes moved, not fewer).
`loading`: quantize each linear as it is loaded (`quantize_on_load`, the full-precision model never
exists whole) or load everything first (`load_then_quantize`); `load_peak_mem_bytes` is measured
on that phase. Lossy: the logits stay within LOGIT_TOLERANCE of the reference's; token agreement,
and on the `reference` preset the perplexity delta on held-out text, say what it costs.
The quantized linears and the loaders live in `labkit.blocks.quant`.
"""
from __future__ import annotations

import atexit
import dataclasses
import functools
import math
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from labkit import hardware, planner
from labkit.blocks import calibrated, quant
from labkit.blocks.decoding import generate_cached
from labkit.blocks.kv_caches import StaticCache
from labkit.blocks.model import build_model
from labkit.config import DTYPE_BYTES, MODELS, ConfigError, ModelConfig, RunConfig, knob, torch_dtype
from labkit.measure.clock import clock
from labkit.measure.memory import MemoryMeter, storage_bytes
from labkit.workload import Comparison, SkipVariant, Workload

VARIANTS = ("none", "int8", "int4", "fp8", "gptq_int4", "awq_int4", "w8a8", "smoothquant_w8a8")
CALIBRATED = calibrated.STORAGE  # variant -> the RTN scheme whose storage it has (its bytes)
RTN_OF = {"gptq_int4": "int4", "awq_int4": "int4", "w8a8": "int8", "smoothquant_w8a8": "w8a8"}
# ^ what each calibrated variant is measured beside: RTN at the same bits; SmoothQuant beside
# plain W8A8, which is beside int8 weight-only
REFERENCE = "none"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"new_tokens": 16}, {"new_tokens": 8, "num_layers": 2},
             {"new_tokens": 8, "num_layers": 1, "calib_sequences": 2, "calib_len": 64})

LOADINGS = tuple(quant.LOADINGS)
_GPU = {"batch_size": 1, "prompt_len": 128, "new_tokens": 128, "dtype": "bfloat16"}
SIZES = {"tiny": {"batch_size": 1}, "reference": {"batch_size": 1},
         **{p: _GPU for p in ("small", "medium", "gpt2-124m", "llama-2-7b", "llama-3-8b",
                              "llama-3-70b", "mistral-7b")}}
# max |logits - reference| / max |reference| on the prompt: past this the quantizer is broken (a
# wrong scale, a swapped nibble), not just lossy. Random weights are the hardest case (nothing
# to average), and the error grows with depth and width. Correct quantizers, bf16: int8 1.9% on
# the tiny model, 2.9% on small (12 layers), 5.2% on medium (16 layers of 2048; 6.8% on an H200
# over 128 + 128 tokens); int4 group 64 30.9% on small, 60.2% on medium (H200); fp8 20.4% on
# medium (H200). Broken ones, small: int8 with its scale halved 54%, int4 with its nibbles
# swapped 137%.
EVAL_SHAPE = (8, 128)  # held-out (sequences, tokens) for perplexity on the reference preset
LOGIT_TOLERANCE = {"none": 0.0, "int8": 0.15, "fp8": 0.3, "int4": 0.9, "gptq_int4": 0.9,
                   "awq_int4": 0.9, "w8a8": 0.3, "smoothquant_w8a8": 0.3}


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="weight storage")
    prompt_len: int = knob(16, min=1, help="prompt tokens")
    new_tokens: int = knob(32, min=1, help="tokens generated per sequence")
    group_size: int = knob(64, choices=(32, 64, 128), help="int4: inputs sharing a scale and zero point")
    kernel: str = knob("auto", choices=quant.KERNELS,
                       help="auto/packed: torch's packed kernels where they serve; dequant: plain PyTorch")
    loading: str = knob("quantize_on_load", choices=LOADINGS, help="quantize per linear as loaded, "
                        "or load the whole model first (calibrated variants: always the whole model)")
    calib_sequences: int = knob(8, min=1, help="calibrated variants: calibration sequences")
    calib_len: int = knob(128, min=2, help="calibrated variants: tokens per calibration sequence")
    uses_seq_len = False


def validate(cfg: Config) -> None:
    if cfg.preset == "reference" and cfg.model != MODELS["reference"]:
        raise ConfigError("the reference preset loads the trained model; its shape cannot be set")


def skip_reason(cfg: Config) -> str | None:
    if cfg.variant == "fp8":
        if not cfg.device.startswith("cuda"):
            return "fp8 weights are for GPUs with compute capability 8.9 or newer; this is a CPU"
        if torch.cuda.get_device_capability(cfg.device) < (8, 9):
            return "fp8 needs compute capability 8.9 (Ada, Hopper) or newer"
        if cfg.kernel == "packed":
            return "kernel=packed: torch has no weight-only fp8 kernel; use auto or dequant"
    return None


# --- bytes: the napkin math ---------------------------------------------------------------------

def linear_shapes(m: ModelConfig) -> list[tuple[int, int]]:
    """(out_features, in_features) of every quantized linear, in load order: per block q, k, v,
    o, then the MLP (w1, w3 for SwiGLU, w2: `planner.linear_shapes`); last the output head."""
    block = list(planner.linear_shapes(m).values())
    return block * m.num_layers + [(m.vocab_size, m.hidden_size)]


def layer_bytes(cfg: Config, variant: str | None = None) -> list[int]:
    v = variant or cfg.variant
    return [quant.weight_bytes(n, k, CALIBRATED.get(v, v), cfg.group_size, DTYPE_BYTES[cfg.dtype])
            for n, k in linear_shapes(cfg.model)]


def predicted_weight_bytes(cfg: Config, variant: str | None = None) -> int:
    return sum(layer_bytes(cfg, variant))


def other_param_bytes(cfg: Config) -> int:
    """The parameters not quantized (embedding, norms, biases), in the model's dtype."""
    return planner.param_bytes(cfg.model, cfg.dtype) - predicted_weight_bytes(cfg, "none") \
        + (cfg.model.vocab_size * cfg.model.hidden_size * DTYPE_BYTES[cfg.dtype]
           if cfg.model.tie_embeddings else 0)  # a tied head is counted by param_bytes once


def predicted_load_peak(cfg: Config) -> int:
    """Tensors held at the loading phase's worst moment (the quantizer's temporaries, a chunk of
    rows, left out). load_then_quantize: the whole model in its dtype plus the first linear's
    quantized form; quantize_on_load: the rest of the model, the linears quantized so far, and
    the linear being quantized in both forms. The reference and the calibrated variants load the
    whole model (the calibration comes after the loading phase)."""
    full, quantized = layer_bytes(cfg, "none"), layer_bytes(cfg)
    if cfg.variant == "none" or cfg.variant in CALIBRATED:
        return planner.param_bytes(cfg.model, cfg.dtype)
    if cfg.loading == "load_then_quantize":
        return planner.param_bytes(cfg.model, cfg.dtype) + quantized[0]
    return other_param_bytes(cfg) + max(sum(quantized[:i + 1]) + full[i] for i in range(len(full)))


def bytes_read(cfg: Config) -> int:
    """Bytes one generation reads: the linears' weights as stored and the norms once per forward
    pass (prefill + new_tokens - 1 decode steps), plus the cache held at each decode step. The
    embedding rows looked up (batch x hidden per pass) are left out: negligible."""
    m = cfg.model
    norms = (2 * m.num_layers + 1) * m.hidden_size * DTYPE_BYTES[cfg.dtype]
    held = sum(cfg.prompt_len + i for i in range(1, cfg.new_tokens))
    kv = cfg.batch_size * held * planner.kv_bytes_per_token(m, cfg.dtype)
    return cfg.new_tokens * (predicted_weight_bytes(cfg) + norms) + kv


# --- loading -------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4)
def _seeded_checkpoint(m: ModelConfig, seed: int) -> str:
    """A seeded model of shape `m` written once per process as a .safetensors file (fp32): the
    random-weight presets load from a file as the reference preset does."""
    from labkit.blocks.reference import save_weights

    folder = tempfile.mkdtemp(prefix="labkit-quant-")
    atexit.register(shutil.rmtree, folder, True)
    path = str(Path(folder) / "model.safetensors")
    save_weights(build_model(m, seed=seed), path)
    return path


def checkpoint_path(cfg: Config) -> str:
    """The file the model loads from: the shipped reference weights (checksum checked; a skip
    when missing or altered) or a seeded model of the preset's shape."""
    if cfg.preset != "reference":
        return _seeded_checkpoint(cfg.model, cfg.seed)
    from labkit.blocks import reference

    try:
        record = reference.reference_record()
        path = reference.REFERENCE_DIR / record["file"]
        if not path.is_file() or reference.sha256(path) != record["sha256"]:
            raise ConfigError(f"{path} is missing or does not match reference.json; regenerate it "
                              f"with `{reference.REGENERATE}`")
    except ConfigError as e:
        raise SkipVariant(str(e)) from e
    return str(path)


def load(cfg: Config):
    """The model, loaded by `cfg.loading` (the reference loads whole, unquantized; a calibrated
    variant loads whole, then is calibrated)."""
    model = load_weights(cfg)
    calibrate(cfg, model)
    return model


def load_weights(cfg: Config):
    """The loading phase: the model quantized by `cfg.loading` (RTN variants), or whole (the
    reference and the calibrated variants, which `calibrate` quantizes after)."""
    checkpoint = quant.open_checkpoint(checkpoint_path(cfg))
    kw = {"dtype": torch_dtype(cfg.dtype), "device": cfg.device, "attention": cfg.attention}
    if cfg.variant in CALIBRATED:
        return quant.load_full(cfg.model, checkpoint, **kw)
    return load_rtn(cfg, checkpoint, kw)


def calibrate(cfg: Config, model) -> float:
    """Quantizes a calibrated variant's model in place: the seconds it took (0 for RTN)."""
    if cfg.variant not in CALIBRATED:
        return 0.0
    start = clock(cfg.device)
    calibrated.apply_calibrated(model, cfg.variant, calibration_text(cfg), group_size=cfg.group_size,
                                kernel=cfg.kernel)
    return clock(cfg.device) - start


def load_rtn(cfg: Config, checkpoint: quant.Checkpoint, kw: dict):
    if cfg.variant == "none":
        return quant.load_full(cfg.model, checkpoint, **kw)
    if cfg.loading == "quantize_on_load":
        return quant.load_quantized(cfg.model, checkpoint, scheme=cfg.variant,
                                    group_size=cfg.group_size, kernel=cfg.kernel, **kw)
    return quant.apply_weight_quant(quant.load_full(cfg.model, checkpoint, **kw), cfg.variant,
                                    group_size=cfg.group_size, kernel=cfg.kernel)


def make_text(cfg: Config) -> torch.Tensor:
    """(B, prompt_len + new_tokens): held-out text on the `reference` preset, else random tokens."""
    length = cfg.prompt_len + cfg.new_tokens
    if cfg.preset == "reference":
        from labkit.blocks import reference

        return reference.heldout(cfg.batch_size, length).to(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return torch.randint(0, cfg.model.vocab_size, (cfg.batch_size, length), generator=gen).to(cfg.device)


def calibration_text(cfg: Config) -> torch.Tensor:
    """(calib_sequences, calib_len) tokens the calibrated variants are fitted on: the reference
    language at its own seed (`reference.calibration_text`) on the `reference` preset, else
    random tokens at seed + 2; never the text measured (`eval_text`, `make_text`)."""
    shape = (cfg.calib_sequences, cfg.calib_len)
    if cfg.preset == "reference":
        from labkit.blocks import reference

        return reference.calibration_text(*shape).to(cfg.device)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    return torch.randint(0, cfg.model.vocab_size, shape, generator=gen).to(cfg.device)


def eval_text(cfg: Config, text: torch.Tensor) -> torch.Tensor:
    """What the logits, next-token agreement and perplexity are measured on: EVAL_SHAPE held-out
    sequences on the `reference` preset, else the generation's own text."""
    if cfg.preset != "reference":
        return text
    from labkit.blocks import reference

    return reference.heldout(*EVAL_SHAPE).to(cfg.device)


# --- the experiment ------------------------------------------------------------------------------

def build(cfg: Config) -> Workload:
    with MemoryMeter(cfg.device) as meter:  # the loading phase alone (the harness times decoding)
        model = load_weights(cfg)
        load_peak = meter.peak_bytes
    # outside the meter: on a CPU its tracker would add a Python call to each of GPTQ's ops
    calibration_s = calibrate(cfg, model)
    text = make_text(cfg)
    prompt = text[:, :cfg.prompt_len]
    m = cfg.model

    def step() -> torch.Tensor:
        cache = StaticCache(num_layers=m.num_layers, batch=cfg.batch_size, kv_heads=m.num_kv_heads,
                            head_dim=m.head_dim, max_len=cfg.prompt_len + cfg.new_tokens,
                            dtype=torch_dtype(cfg.dtype), device=cfg.device)
        return generate_cached(model, prompt, cfg.new_tokens, cache)

    @torch.inference_mode()
    def check() -> dict:
        evaluation = eval_text(cfg, text)
        logits = model(evaluation[:, :-1]).float()  # (B, L - 1, vocab), teacher-forced
        out = {"tokens": step(), "logits": logits, "next_tokens": logits.argmax(-1)}
        if cfg.preset == "reference":
            nll = F.cross_entropy(logits.flatten(0, 1), evaluation[:, 1:].flatten())
            out["perplexity"] = math.exp(nll.item())
        return out

    def report() -> dict[str, float]:
        stored = storage_bytes(quant.stored_weights(model))
        calibration = {"calibration_s": calibration_s} if cfg.variant in CALIBRATED else {}
        return {"weight_bytes_ratio": stored / predicted_weight_bytes(cfg, "none"),
                "load_peak_mem_bytes": load_peak, **calibration, **quant.kernel_paths(model)}

    return Workload(
        step=step, check=check, tokens_per_step=cfg.batch_size * cfg.new_tokens,
        energy_tokens=cfg.batch_size * cfg.new_tokens,
        tensors={"weight_bytes": lambda: quant.stored_weights(model)},
        per_second={"achieved_gbps": bytes_read(cfg) / 1e9}, report=report,
        notes={**notes(cfg), "packed_layers": path_note(cfg, model)},
        compute_dtype=cfg.dtype, count_flops=False)  # FlopCounterMode does not see the packed ops


def path_note(cfg: Config, model) -> str:
    """Which kernel ran each quantized linear, and why a layer was dequantized."""
    if cfg.variant == "none":
        return "none: F.linear on the model-dtype weights"
    w8a8 = cfg.variant in ("w8a8", "smoothquant_w8a8")
    scheme = "w8a8" if w8a8 else CALIBRATED.get(cfg.variant, cfg.variant)
    reasons: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, quant.QuantLinear) and not mod.packed:
            why = "kernel=dequant" if cfg.kernel == "dequant" else (
                calibrated.w8a8_packed_reason(mod.out_features, mod.in_features, cfg.kernel) if w8a8
                else quant.packed_reason(scheme, mod.out_features, mod.in_features, cfg.group_size,
                                         cfg.device, torch_dtype(cfg.dtype))) or "the kernel refused the layout"
            reasons[why] = reasons.get(why, 0) + 1
    paths = quant.kernel_paths(model)
    op = {"int8": "aten._weight_int8pack_mm", "int4": "aten._weight_int4pack_mm"
          + ("" if cfg.device.startswith("cuda") else "_for_cpu"),
          "w8a8": "torch._int_mm (int8 x int8 -> int32, activations quantized per token)"}.get(scheme, "-")
    why = "; ".join(f"{n} because {r}" for r, n in reasons.items())
    fallback = "emulated in fp32" if w8a8 else "dequantized then F.linear"
    return (f"{cfg.variant} (kernel={cfg.kernel}): {paths['packed_layers']} linears on {op}, "
            f"{paths['dequant_layers']} {fallback}" + (f" ({why})" if why else ""))


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Logits within LOGIT_TOLERANCE of the reference's (relative, teacher-forced on the same
    text); reported: agreement with the reference's greedy tokens (free-running: after one flip
    the continuations differ, so it drops fast), next-token agreement under teacher forcing (each
    position on the same prefix: no cascade) and the perplexity delta."""
    same = reference["tokens"] == outputs["tokens"]
    forced = reference["next_tokens"] == outputs["next_tokens"]
    ref = reference["logits"]
    error = ((outputs["logits"] - ref).abs().max() / ref.abs().max()).item()
    metrics = {"token_agreement": same.sum().item() / same.numel(),
               "next_token_agreement": forced.sum().item() / forced.numel(), "logit_rel_error": error}
    if "perplexity" in outputs and "perplexity" in reference:
        metrics["perplexity"] = outputs["perplexity"]
        metrics["perplexity_delta"] = outputs["perplexity"] - reference["perplexity"]
        metrics["perplexity_delta_pct"] = 100 * metrics["perplexity_delta"] / reference["perplexity"]
    limit = LOGIT_TOLERANCE[cfg.variant]
    ok = error <= limit
    return Comparison(metrics, ok, "" if ok else f"logits off by {100 * error:.1f}% (tolerance "
                                                 f"{100 * limit:.0f}%)")


def expected(cfg: Config) -> dict[str, float]:
    out: dict[str, float] = {"weight_bytes": predicted_weight_bytes(cfg),
                             "weight_bytes_ratio": predicted_weight_bytes(cfg) / predicted_weight_bytes(cfg, "none"),
                             "load_peak_mem_bytes": predicted_load_peak(cfg)}
    if cfg.variant == "none":
        out.update(token_agreement=1.0, next_token_agreement=1.0, logit_rel_error=0.0,
                   packed_layers=0, dequant_layers=0)
    ceil = hardware.ceilings(cfg.device, num_threads=cfg.num_threads)
    if ceil.bandwidth_gbps:
        out["achieved_gbps"] = ceil.bandwidth_gbps  # the ceiling
        out["tokens_per_s"] = cfg.batch_size * cfg.new_tokens / (bytes_read(cfg) / (ceil.bandwidth_gbps * 1e9))
    return out


def notes(cfg: Config) -> dict[str, str]:
    return {
        "weight_bytes": "every block linear and the output head as stored (data + 16-bit scales "
                        "and zero points; biases, embedding and norms not counted); predicted: "
                        "N K bytes_per_value (none), N K + 2 N (int8, fp8), "
                        "N ceil(K/2) + 4 N ceil(K/group_size) (int4, the last group may be shorter); "
                        "gptq_int4 and awq_int4 store int4's format, w8a8 and smoothquant_w8a8 "
                        "int8's (AWQ's and SmoothQuant's scales are folded into the op before).",
        "weight_bytes_ratio": "weight_bytes over the same linears in the model's dtype",
        "tokens_per_s": "predicted: reading the stored weights (and the cache) once per token at the "
                        "device's bandwidth, an upper bound; the dequant path reads the packed "
                        "weight and then writes and reads a full-precision copy, so it falls short.",
        "achieved_gbps": "the predicted bytes of a generation (weights as stored once per pass, "
                         "the cache held at each step) over its time; predicted: the ceiling.",
        "load_peak_mem_bytes": f"peak bytes allocated while loading ({cfg.loading}) from a "
                               "memory-mapped checkpoint (the file's pages are not counted); "
                               "predicted: the tensors held at the worst moment, without the "
                               "quantizer's temporaries (calibrated variants: loaded whole, "
                               "calibrated after).",
        "logit_rel_error": "max |logits - reference| / max |reference logits|, teacher-forced",
        "token_agreement": "share of the greedy tokens equal to the reference's (free-running: "
                           "one flip at a near-tie and the continuations part)",
        "next_token_agreement": "share of positions where the argmax equals the reference's on the "
                                "same prefix (teacher-forced: no cascade)",
        "calibration_s": f"seconds fitting the calibrated variant on {cfg.calib_sequences} x "
                         f"{cfg.calib_len} calibration tokens ({calibration_source(cfg)}), block by "
                         "block, loading excluded",
    }


def calibration_source(cfg: Config) -> str:
    """Which tokens the calibrated variants are fitted on, against those they are measured on."""
    if cfg.preset == "reference":
        from labkit.blocks import reference

        return (f"the reference language at seed {reference.CALIBRATION_SEED}; perplexity and "
                f"agreement on {EVAL_SHAPE[0]} x {EVAL_SHAPE[1]} held-out tokens at seed "
                f"{reference.HELDOUT_SEED}")
    return (f"random tokens at seed {cfg.seed + 2}; agreement on the generation's own random "
            f"tokens at seed {cfg.seed + 1}")


COMPARED = ("perplexity_delta_pct", "next_token_agreement", "logit_rel_error", "weight_bytes",
            "calibration_s")
GOAL_DELTA_RATIO = 0.5  # issue 28: GPTQ or AWQ at int4, group 64, reference preset, at most half
# of RTN's perplexity delta


def against_rtn(measured: dict[str, dict[str, float]]) -> list[dict]:
    """Each calibrated variant that ran beside what it is measured against (`RTN_OF`), from
    {variant: {metric: value}} (`viz.metric_table(frame).to_dict()`): its metrics, the other's
    (`beside_*`) and `delta_ratio`, its perplexity delta over the other's (reference preset)."""
    out = []
    for variant, beside in RTN_OF.items():
        if variant not in measured or beside not in measured:
            continue
        mine, theirs = measured[variant], measured[beside]
        row: dict = {"variant": variant, "beside": beside}
        for m in COMPARED:
            row[m], row[f"beside_{m}"] = mine.get(m, math.nan), theirs.get(m, math.nan)
        other = row["beside_perplexity_delta_pct"]
        row["delta_ratio"] = row["perplexity_delta_pct"] / other if other else math.nan
        out.append(row)
    return out


def loading_peaks(cfg: Config) -> list[dict]:
    """Each loading path's measured and predicted peak for `cfg`'s variant: the loading phase
    alone, without decoding (a row per path)."""
    out = []
    for loading in LOADINGS:
        point = dataclasses.replace(cfg, loading=loading)
        with MemoryMeter(cfg.device) as meter:
            load(point)
            peak = meter.peak_bytes
        out.append({"loading": loading, "measured_peak_bytes": peak,
                    "predicted_peak_bytes": predicted_load_peak(point)})
    return out
