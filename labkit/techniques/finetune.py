"""Fine-tuning on a small memory: full, LoRA, QLoRA and LoRA on an int8 or int4 base, measured
beside the planner.

- `full` (the reference): every weight trained, AdamW.
- `lora`: the base frozen; rank-`lora_rank` adapters (PEFT) on `lora_targets`, output
  W x + (lora_alpha / r) B A x; AdamW holds state for the adapters only.
- `qlora`: as `lora`, the base's block linear weights in NF4 with double-quantized scalers
  (torchao's NF4Tensor), dequantized to the compute dtype for each matmul.
- `lora_int8`, `lora_int4`: as `lora`, the base's block linear weights in weight-only int8 (a
  scale per output channel) or int4 (a scale and zero point per 64 inputs), labkit's
  round-to-nearest formats (`labkit.blocks.quant`), dequantized for each matmul as NF4 is.
- `lora_ckpt`: `lora` with every block checkpointed (recomputed in backward).
Compute dtype: bf16 where the device has native bf16 (AVX-512 BF16 / AMX on a CPU, compute
capability 8.0+ on a GPU), fp32 otherwise (`compute` overrides): weights, adapters, gradients and
AdamW's moments all in it (pure 16-bit training, as torchtune's bf16 recipes). The adapters and
the NF4 base live in `labkit.blocks.lora`.

`full` trains the base, so the LoRA variants are not compared with its losses: each variant's
checks are its own mechanisms (`compare` ignores the reference's outputs): at initialisation the
LoRA model's logits equal the base's exactly (B = 0); after the steps the frozen base is bitwise
unchanged; the adapters' gradients equal the low-rank update's computed by hand; the NF4 weights
stay within the format's error bound; on the `reference` preset, a quantized base's perplexity
against the fp32 base's on held-out text. `frontier()` finds the longest sequence each variant
fits in a memory budget: batch_finder's grow-then-bisect search, started at the planner's answer.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from labkit import hardware, planner
from labkit.blocks import lora
from labkit.blocks.search import find_largest
from labkit.blocks.training import Trainer, lm_loss
from labkit.blocks.transforms import apply_checkpointing
from labkit.config import ConfigError, MODELS, RunConfig, knob, torch_dtype
from labkit.measure.memory import MemoryMeter, fits_in_memory, storage_bytes
from labkit.workload import Comparison, SkipVariant, Workload

VARIANTS = ("full", "lora", "qlora", "lora_int8", "lora_int4", "lora_ckpt")
REFERENCE = "full"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"batch_size": 2, "seq_len": 32}, {"batch_size": 1, "seq_len": 32, "num_layers": 2})

COMPUTE = {"fp32": "float32", "bf16": "bfloat16"}
# Normwise relative difference of the adapters' gradients from the hand-computed ones: the same
# products summed in another order (fp32), or bf16 gradients against an fp32 hand computation
# from the same bf16 inputs (bf16 keeps 8 significant bits: 2^-8 = 0.4% per rounding).
GRAD_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}
EVAL_SHAPE = (8, 128)  # held-out (sequences, tokens) for the reference preset's perplexity


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="what is trained and how it is stored")
    steps: int = knob(3, min=1, help="training steps on the same seeded batch")
    lr: float = knob(1e-3, min=0.0, help="AdamW learning rate")
    lora_rank: int = knob(8, min=1, help="adapter rank r")
    lora_alpha: float = knob(16.0, min=0.0, help="adapter scale: outputs add (alpha / r) B A x")
    lora_targets: str = knob("q,v", help="comma list of q, k, v, o, gate, up, down (or attn, all)")
    compute: str = knob("auto", choices=("auto", *COMPUTE),
                        help="compute dtype (auto: bf16 where the device has native bf16)")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"finetune chooses its dtype with `compute` (got dtype={cfg.dtype}); "
                          f"valid compute: auto, {', '.join(COMPUTE)}")
    planner.lora_module_names(cfg.model, cfg.lora_targets)  # each target exists in this block
    if cfg.preset == "reference" and cfg.model != MODELS["reference"]:
        raise ConfigError("the reference preset loads the trained model; its shape cannot be set")


def skip_reason(cfg: Config) -> str | None:
    name = lora.missing_library("lora" if cfg.variant == "lora_ckpt" else cfg.variant)
    if name:
        return f"{cfg.variant} needs {name}, which is not installed: pip install labkit[finetune]"
    if cfg.device.startswith("cuda") and compute_dtype(cfg) == "bfloat16" and not torch.cuda.is_bf16_supported():
        return "compute=bf16 on a GPU without bf16 (compute capability 8.0 or newer needed)"
    return None


def compute_dtype(cfg: Config) -> str:
    """float32 or bfloat16: `compute`, or where auto, bf16 when the device has it natively."""
    if cfg.compute != "auto":
        return COMPUTE[cfg.compute]
    if cfg.device.startswith("cuda"):
        native = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    else:
        native = hardware.cpu_info().native_bf16
    return "bfloat16" if native else "float32"


def targets(cfg: Config) -> tuple[str, ...]:
    return planner.parse_lora_targets(cfg.lora_targets)


# --- the step ---------------------------------------------------------------------------------------

def base_model(cfg: Config, dtype: torch.dtype) -> torch.nn.Module | None:
    """The trained model on the `reference` preset (a skip when its weights are missing), else
    None (the Trainer's seeded one)."""
    if cfg.preset != "reference":
        return None
    from labkit.blocks import reference

    try:
        return reference.load_reference(device=cfg.device, dtype=dtype)
    except ConfigError as e:
        raise SkipVariant(str(e)) from e


def finetune_step(cfg: Config, before_adapters=None) -> tuple[Trainer, float]:
    """The variant's training step, and the NF4 weights' worst error against its bound (nan when
    not NF4). Order: the base in the compute dtype, then NF4, int8 or int4 (from the
    weights in that dtype, which is what it dequantizes to), then `before_adapters(model)` (the
    B = 0 check's base logits), then the adapters on the (quantized) linears, then checkpointing
    around the blocks, then the optimizer over what trains."""
    dtype = torch_dtype(compute_dtype(cfg))
    trainer = Trainer(cfg, weights=dtype, lr=cfg.lr, optimizer=False)
    loaded = base_model(cfg, dtype)
    if loaded is not None:
        trainer.model = trainer.net = loaded
    nf4_ratio = lora.quantize_base(trainer.model, cfg.variant)
    if before_adapters is not None:
        before_adapters(trainer.model)
    if cfg.variant != "full":
        lora.apply_lora(trainer.model, targets(cfg), rank=cfg.lora_rank, alpha=cfg.lora_alpha)
    if cfg.variant == "lora_ckpt":
        apply_checkpointing(trainer, "full")
    trainer.build_optimizer()  # over what trains: the adapters (or, for full, everything)
    return trainer, nf4_ratio


# --- the checks -------------------------------------------------------------------------------------

@torch.no_grad()
def logits_of(model: torch.nn.Module, inputs: torch.Tensor) -> bytes:
    """The logits' bytes (a host copy outside torch, so the meter does not hold it)."""
    return model(inputs).float().cpu().numpy().tobytes()


def adapter_grad_difference(trainer: Trainer) -> float:
    """One forward and backward; the normwise relative difference of the first adapter's
    gradients from the low-rank update's by hand: with X (N, in) its input, G (N, out) the
    loss's gradient at its output and s = alpha / r, dL/dB = s G^T (X A^T) and
    dL/dA = s (G B)^T X. The gradients are dropped afterwards."""
    layer = next(m for m in trainer.model.modules() if hasattr(m, "lora_A") and "default" in m.lora_A)
    seen = {}

    def capture(module, args, out):
        seen["x"] = args[0].detach()
        out.register_hook(lambda g: seen.__setitem__("g", g.detach()))

    hook = layer.register_forward_hook(capture)
    try:
        trainer.forward().backward()
    finally:
        hook.remove()
    A, B, s = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    X, G = seen["x"].flatten(0, -2).float(), seen["g"].flatten(0, -2).float()
    with torch.no_grad():
        hand = {"B": s * G.T @ (X @ A.float().T), "A": s * (G @ B.float()).T @ X}
    got = {"A": A.grad.float(), "B": B.grad.float()}
    trainer.drop_grads()
    return max(float((got[k] - hand[k]).norm() / hand[k].norm().clamp_min(1e-30)) for k in hand)


def heldout_perplexity(model: torch.nn.Module, device: str) -> float:
    """exp(mean next-token NLL) on EVAL_SHAPE held-out sequences of the reference language."""
    from labkit.blocks import reference

    text = reference.heldout(*EVAL_SHAPE).to(device)
    with torch.no_grad():
        return math.exp(lm_loss(model(text[:, :-1]), text[:, 1:]).item())


def base_perplexities(cfg: Config, model: torch.nn.Module) -> dict[str, float]:
    """On the reference preset: the (quantized) base's held-out perplexity and the fp32 base's."""
    if cfg.preset != "reference":
        return {}
    fp32 = base_model(cfg, torch.float32)
    return {"perplexity": heldout_perplexity(model, cfg.device),
            "perplexity_fp32": heldout_perplexity(fp32, cfg.device)}


# --- the experiment ---------------------------------------------------------------------------------

def build(cfg: Config) -> Workload:
    init: dict = {}

    def before_adapters(model):  # the base as the adapters will find it (quantized or not)
        init["logits"] = logits_of(model, step_inputs(cfg))
        init.update(base_perplexities(cfg, model) if cfg.variant in planner.BASE_FORMAT else {})

    trainer, nf4_ratio = finetune_step(cfg, before_adapters)
    model, grads = trainer.model, {}
    if cfg.variant != "full":  # B = 0: the adapters add exact zeros
        init["init_logits_equal"] = float(logits_of(model, trainer.inputs) == init["logits"])
    trainer.grad_hooks.append(lambda s: grads.update(bytes=storage_bytes(
        p.grad for p in s.model.parameters() if p.grad is not None)))

    def check() -> dict:
        frozen = lora.digest(lora.base_tensors(model))
        out = trainer.train(cfg.steps)
        out.update(loss=out["losses"][-1], nf4_error_ratio=nf4_ratio,
                   **{k: v for k, v in init.items() if k != "logits"})
        if cfg.variant != "full":
            out["base_unchanged"] = float(lora.digest(lora.base_tensors(model)) == frozen)
            out["adapter_grad_rel_diff"] = adapter_grad_difference(trainer)
        return out

    return Workload(
        step=trainer.step, check=check, tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": lambda: lora.base_tensors(model) + adapter_params(model),
                 "linear_weight_bytes": lambda: lora.linear_weights(model),
                 "optimizer_bytes": trainer.optimizer_tensors},
        forward=trainer.forward, resident=lambda: [*model.parameters(), *model.buffers()],
        report=lambda: {"grad_bytes": grads.get("bytes", 0), **counts(model)},
        notes=notes(cfg), compute_dtype=compute_dtype(cfg))


def step_inputs(cfg: Config) -> torch.Tensor:
    from labkit.blocks.training import make_batch

    return make_batch(cfg)[0]


def adapter_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p for name, p in model.named_parameters() if lora._is_adapter(name)]


def counts(model: torch.nn.Module) -> dict[str, float]:
    """trainable_params, and the share of every stored weight they are (%)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(t.numel() for t in lora.base_tensors(model)) + sum(p.numel() for p in adapter_params(model))
    return {"trainable_params": trainable, "trainable_pct": 100 * trainable / total}


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Each variant's own mechanisms (the reference's outputs do not apply: `full` trains the
    base, so its losses are not the LoRA variants' to match): B = 0 logits, the frozen base
    bitwise, the adapters' gradients by hand, NF4's error bound."""
    keys = ("loss", "init_logits_equal", "base_unchanged", "adapter_grad_rel_diff",
            "nf4_error_ratio", "perplexity", "perplexity_fp32")
    metrics = {k: outputs[k] for k in keys if k in outputs and not _nan(outputs[k])}
    if "perplexity" in metrics:
        metrics["perplexity_delta"] = metrics["perplexity"] - metrics["perplexity_fp32"]
    tolerance = GRAD_TOLERANCE[compute_dtype(cfg)]
    failed = [what for what, bad in (
        ("logits at B = 0 differ from the base's", metrics.get("init_logits_equal", 1.0) != 1.0),
        ("the frozen base changed", metrics.get("base_unchanged", 1.0) != 1.0),
        (f"adapter gradients {metrics.get('adapter_grad_rel_diff', 0.0):.2e} from the hand "
         f"computation (> {tolerance:g})", metrics.get("adapter_grad_rel_diff", 0.0) > tolerance),
        (f"NF4 error {metrics.get('nf4_error_ratio', 0.0):.3f}x its bound",
         metrics.get("nf4_error_ratio", 0.0) > 1.0),
        ("a loss is not finite", not math.isfinite(outputs["loss"]))) if bad]
    return Comparison(metrics, not failed, "; ".join(failed))


def _nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


# --- the napkin math --------------------------------------------------------------------------------

def method(variant: str) -> str:
    return "lora" if variant == "lora_ckpt" else variant


def plan(cfg: Config, seq_len: int | None = None) -> planner.MemoryPlan:
    """planner.finetune_memory of this variant's step (at `seq_len` when given)."""
    return planner.finetune_memory(
        cfg.model, method=method(cfg.variant), lora_rank=cfg.lora_rank, lora_targets=targets(cfg),
        batch_size=cfg.batch_size, seq_len=seq_len or cfg.seq_len,
        compute_dtype="bf16" if compute_dtype(cfg) == "bfloat16" else "fp32",
        checkpointing="full" if cfg.variant == "lora_ckpt" else "none",
        device=torch.device(cfg.device).type)


def expected(cfg: Config) -> dict[str, float]:
    p, m = plan(cfg), cfg.model
    out = {"trainable_params": planner.trainable_params(m, method(cfg.variant), lora_rank=cfg.lora_rank,
                                                        lora_targets=targets(cfg)),
           "param_bytes": p.param_bytes, "linear_weight_bytes": p.linear_weight_bytes,
           "grad_bytes": p.grad_bytes, "optimizer_bytes": p.optimizer_bytes,
           "activation_bytes": p.activation_bytes, "peak_mem_bytes": p.total_bytes,
           "init_logits_equal": 1.0, "base_unchanged": 1.0, "adapter_grad_rel_diff": 0.0}
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(compute_dtype(cfg))
    if peak:
        flops = planner.train_step_flops(m, batch=cfg.batch_size, seq_len=cfg.seq_len, attention=cfg.attention)
        out["tokens_per_s"] = cfg.batch_size * cfg.seq_len / (flops / (peak * 1e12))
    return out


def notes(cfg: Config) -> dict[str, str]:
    dtype = compute_dtype(cfg)
    why = ("chosen" if cfg.compute != "auto" else
           "native bf16 here" if dtype == "bfloat16" else "no native bf16 here (it would be emulated)")
    out = {"loss": f"compute dtype {dtype} ({why}); {cfg.steps} steps on one seeded batch. "
                   "full trains the base, so the LoRA variants' losses are not compared with it.",
           "tokens_per_s": "predicted: the full step's FLOPs at the device's peak (a bound; a "
                           "frozen base skips its weight gradients, a third of the FLOPs).",
           "linear_weight_bytes": "the base's block linear weights as stored (NF4: 4-bit codes, "
                                  "int8 scalers per 64, a factor per scaler block; int8: a byte and "
                                  "a 16-bit scale per row; int4: 4-bit codes, a 16-bit scale and "
                                  "zero point per 64), adapters excluded.",
           "grad_bytes": "measured on the final gradients before the update: trainable weights only."}
    if cfg.variant in planner.BASE_FORMAT:
        out["activation_bytes"] = (f"each matmul dequantizes its {planner.BASE_FORMAT[cfg.variant]} "
                                   "weight to the compute dtype: a transient copy, freed after the "
                                   "matmul; only the quantized weight is saved.")
    return out


# --- the frontier: the longest sequence each variant fits ------------------------------------------

SEQ_STEP = 16  # the search's default granularity (tokens): probes are multiples of it


def probe(cfg: Config, seq_len: int, budget: int | None) -> bool:
    """Do two training steps at `seq_len` fit in `budget` bytes (None: the device's own memory)?
    The weights as stored count against it. Afterwards nothing of the probe is alive and the
    memory is back where it was."""
    return fits_in_memory(lambda: _run_probe(dataclasses.replace(cfg, seq_len=seq_len), budget),
                          cfg.device)


def _run_probe(cfg: Config, budget: int | None) -> bool:
    # Built before the meter: quantizing to NF4 holds (chunk, 16) distance temporaries, a
    # load-time cost; the weights it leaves are counted from storage instead.
    trainer, _ = finetune_step(cfg)
    resident = storage_bytes([*trainer.model.parameters(), *trainer.model.buffers()])
    left = None if budget is None else budget - resident
    if left is not None and left <= 0:
        return False
    with MemoryMeter(cfg.device, left):  # counts what is allocated past its entry
        for _ in range(2):  # the first allocates AdamW's state; the second runs with it
            trainer.step()
    return True


def frontier(cfg: Config, budget_gib: float | None, variants=VARIANTS, *, seq_step: int = SEQ_STEP):
    """A DataFrame, one row per variant: the longest sequence (a multiple of `seq_step`, up to the
    model's context) whose training steps fit `budget_gib` (None on a GPU: its memory), beside the
    longest whose planner peak fits. The measured search (batch_finder's grow-then-bisect) starts
    at the planner's answer: a right prediction costs two probes, the answer (it fits) and one
    step longer (it does not); a wrong one costs more, and the search still ends on both."""
    import pandas as pd

    budget = None if budget_gib is None else int(budget_gib * 2**30)
    cap = cfg.model.max_seq_len // seq_step
    limit = budget if budget is not None else hardware.ceilings(cfg.device).memory_bytes
    rows = []
    for variant in variants:
        at = dataclasses.replace(cfg, variant=variant)
        if skip_reason(at):
            continue
        predicted = find_largest(lambda k: plan(at, k * seq_step).total_bytes <= limit,
                                 start=1, cap=cap, step=1)
        search = find_largest(lambda k: probe(at, k * seq_step, budget), start=predicted.found,
                              cap=cap, step=1)
        rows.append({"variant": variant, "max_seq_len": search.found * seq_step,
                     "predicted_max_seq_len": predicted.found * seq_step,
                     "num_probes": len(search.probes), "budget_gib": limit / 2**30,
                     "capped": search.capped})
    return pd.DataFrame(rows)
