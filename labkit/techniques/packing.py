"""Padding-free packing: documents of varied lengths trained in padded rows, or packed into full
rows with and without a per-document attention mask.

- `padded` (the reference): each document alone in its row, right-padded to the batch's longest
  (pads' targets ignored). Every document is computed exactly as it would be on its own.
- `packed_naive`: documents placed whole into rows of `seq_len` tokens (first-fit decreasing),
  the plain causal mask, positions running on across the row: each document attends to the ones
  packed before it (unsloth issue 1207), so its loss is not its own.
- `packed`: the same rows, the block-diagonal causal mask and positions restarting at 0 per
  document (the decoder's `document_ids=`, as HF's DataCollatorWithFlattening, TRL's
  `padding_free` and axolotl's multipack do it).
`batch_size` is the documents per step (the reference's rows), drawn from a seed: log-normal
lengths (median `median_len`, spread `length_sigma`), many short and a few long.

Checked against `padded`: each document's mean loss, and the gradients of the batch's loss (the
mean over every document token: the same tokens in both layouts), within fp32 rounding.
`packed_naive` FAILS that check, as it must: its deltas are reported as a lossy variant's are,
and its rows say why (`documents_isolated` = 0). Measured: the padding fraction (pads / tokens
computed, counted), useful tokens/s (document tokens per second of a training step), the
speed-up over `padded` (timed alternately in one process), the attention pairs the mask allows,
peak memory; predicted beside them from the lengths alone.
"""
from __future__ import annotations

import functools
import statistics
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from labkit import hardware, planner
from labkit.blocks import packing
from labkit.blocks.model import document_mask
from labkit.blocks.training import (Trainer, global_relative_difference, gradient_difference,
                                   step_with_gradients)
from labkit.config import ConfigError, RunConfig, knob
from labkit.measure.clock import seconds
from labkit.workload import Comparison, Workload

VARIANTS = ("padded", "packed_naive", "packed")
REFERENCE = "padded"
SIZES = {"tiny": {"batch_size": 8, "seq_len": 128}}
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"batch_size": 6, "seq_len": 96}, {"batch_size": 4, "seq_len": 64, "num_layers": 2})

# Relative differences allowed against `padded` (fp32): the same sums over other matmul shapes
# and another attention kernel (a masked SDPA against is_causal), a few ulps (1.2e-7 each).
TOLERANCE = 1e-5
PAIRED_STEPS = 3  # padded's step and the variant's, alternately, for the measured speed-up


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="padded rows, or packed rows without / with a document mask")
    median_len: int = knob(12, min=2, help="median document length (tokens); lengths are log-normal")
    length_sigma: float = knob(1.0, min=0.0, max=3.0, help="spread of the log length (0: all the median)")


def validate(cfg: Config) -> None:
    if cfg.dtype != "float32":
        raise ConfigError(f"packing checks per-document losses in float32 (got dtype={cfg.dtype}); "
                          "valid: float32")
    if cfg.median_len > cfg.seq_len:
        raise ConfigError(f"median_len={cfg.median_len} is longer than a row (seq_len={cfg.seq_len}); "
                          f"valid: 2 to {cfg.seq_len}")
    if cfg.seq_len > cfg.model.max_seq_len:
        raise ConfigError(f"seq_len={cfg.seq_len} is past the model's context ({cfg.model.max_seq_len})")


def documents(cfg: Config) -> list[torch.Tensor]:
    """The step's documents: `batch_size` of them, seeded, none longer than a row."""
    return packing.draw_documents(cfg.batch_size, median_len=cfg.median_len, sigma=cfg.length_sigma,
                                  max_len=cfg.seq_len, vocab_size=cfg.model.vocab_size, seed=cfg.seed)


def lengths(cfg: Config) -> list[int]:
    """The step's document lengths (`documents`)."""
    return [len(d) for d in documents(cfg)]


def layout(variant: str) -> str:
    return "padded" if variant == REFERENCE else "packed"


def batch_of(cfg: Config, variant: str | None = None) -> packing.Batch:
    return packing.make_batch(layout(variant or cfg.variant), documents(cfg), cfg.seq_len)


def packing_step(cfg: Config, variant: str | None = None, model=None) -> tuple[Trainer, packing.Batch]:
    """The plain training step (AdamW, fp32) on the variant's batch; `packed` with its document
    mask. `model`: share one model's weights (the paired timing)."""
    variant = variant or cfg.variant
    batch = batch_of(cfg, variant)
    trainer = packing.apply_packing(Trainer(cfg, model=model), batch, document_mask=variant == "packed")
    return trainer, batch


@torch.no_grad()
def document_losses(model, batch: packing.Batch, device: str, masked: bool) -> np.ndarray:
    """Each document's mean next-token loss, (num_documents,) float64, from one forward (with
    the batch's document mask when `masked`)."""
    batch = batch.to(device)
    logits = model(batch.tokens, document_ids=batch.document_ids if masked else None).float()
    nll = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="none",
                          ignore_index=packing.IGNORE)
    kept = batch.targets.flatten() != packing.IGNORE
    ids = batch.document_ids.flatten()[kept]
    total = torch.zeros(len(batch.lengths), dtype=torch.float64, device=nll.device)
    total.index_add_(0, ids, nll[kept].double())
    return (total / torch.tensor(batch.lengths, dtype=torch.float64, device=nll.device).sub(1)).cpu().numpy()


def build(cfg: Config) -> Workload:
    trainer, batch = packing_step(cfg)

    def check() -> dict:
        losses = document_losses(trainer.model, batch, cfg.device, cfg.variant == "packed")  # before the step
        return {**step_with_gradients(trainer), "document_losses": losses}

    return Workload(
        step=trainer.step, check=check, tokens_per_step=batch.num_tokens,
        per_second={"useful_tokens_per_s": sum(batch.lengths)},
        tensors={"param_bytes": trainer.model.parameters, "optimizer_bytes": trainer.optimizer_tensors},
        forward=trainer.forward, resident=trainer.model.parameters,
        report=functools.partial(report, cfg, trainer, batch), notes=notes(cfg), compute_dtype=cfg.dtype)


def report(cfg: Config, trainer: Trainer, batch: packing.Batch) -> dict[str, float]:
    """Counted from the batch and the mask the model builds; the speed-up timed against padded."""
    return {"padding_fraction": batch.padding_fraction, "document_tokens": sum(batch.lengths),
            "num_rows": len(batch.tokens), "attention_pairs": attention_pairs(batch, cfg.variant == "packed"),
            "speedup": speedup(cfg, trainer)}


def attention_pairs(batch: packing.Batch, document_masked: bool) -> int:
    """(query, key) pairs the step's mask lets through for the documents' tokens (a pad's query
    is waste whatever it sees), counted in the mask: the model's `document_mask`, or causal."""
    ids = batch.document_ids
    T = ids.shape[1]
    allowed = (document_mask(ids)[:, 0] if document_masked
               else torch.ones(T, T, dtype=torch.bool).tril().expand(len(ids), T, T))
    return int((allowed & (ids >= 0)[:, :, None]).sum())


def speedup(cfg: Config, trainer: Trainer) -> float:
    """padded's step time over this variant's (the same documents, so the same useful tokens),
    PAIRED_STEPS of each alternately on the same weights, medians; 1 for padded itself."""
    if cfg.variant == REFERENCE:
        return 1.0
    padded, _ = packing_step(cfg, REFERENCE, model=trainer.model)
    times: dict[str, list[float]] = {"padded": [], "mine": []}
    for _ in range(PAIRED_STEPS):
        times["padded"].append(seconds(padded.step, cfg.device))
        times["mine"].append(seconds(trainer.step, cfg.device))
    return statistics.median(times["padded"]) / statistics.median(times["mine"])


# --- the check -------------------------------------------------------------------------------------

def documents_match(reference: dict, outputs: dict) -> Comparison:
    """Each document's mean loss and the batch's gradients against `padded`'s, within TOLERANCE
    (relative): ok only when every document was computed as if alone. The gradients compare over
    the whole model (`global_relative_difference`): a key bias's gradient is zero in exact
    arithmetic (softmax ignores what shifts every score of a query alike), so its own ratio is
    rounding over rounding."""
    ref, got = reference["document_losses"], outputs["document_losses"]
    loss_rel = float(np.max(np.abs(got - ref) / np.abs(ref)))
    grad_rel = global_relative_difference(reference["grads"], outputs["grads"])
    grad_abs, _ = gradient_difference(reference["grads"], outputs["grads"])
    checked = {"document losses": loss_rel, "gradients": grad_rel}
    ok = all(v <= TOLERANCE for v in checked.values())  # a nan is never within
    metrics = {"loss": outputs["loss"], "loss_delta": outputs["loss"] - reference["loss"],
               "document_loss_max_abs_diff": float(np.max(np.abs(got - ref))),
               "document_loss_max_rel_diff": loss_rel, "grad_max_abs_diff": grad_abs,
               "grad_rel_diff": grad_rel, "documents_isolated": float(ok)}
    message = "" if ok else ("differ from padded's (each document alone): " + ", ".join(
        f"{name} by {value:.2e} (<= {TOLERANCE:g})" for name, value in checked.items()))
    return Comparison(metrics, ok, message)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """`documents_match`; packed_naive fails it by design: reported, not raised, so its speed is
    still measured beside the others."""
    result = documents_match(reference, outputs)
    if cfg.variant != "packed_naive" or result.ok:
        return result
    return Comparison(result.metrics, True,
                      "FAILS the per-document check, as it must: the documents attended to each other "
                      f"(no document mask, positions running on); {result.message}")


# --- the napkin math --------------------------------------------------------------------------------

def expected(cfg: Config) -> dict[str, float]:
    """From the documents' lengths alone: padding fraction, rows and attention pairs of an ideal
    packing (packed) or of one row per document (padded), the step's FLOPs and its speed-up over
    padded if time followed the tokens computed."""
    sizes = lengths(cfg)
    rows, T = shape(cfg, sizes)
    pad_rows, pad_T = shape(cfg, sizes, REFERENCE)
    plan = planner.training_memory(cfg.model, batch_size=rows, seq_len=T, precision="fp32",
                                   optimizer="adamw", device=cfg.device)
    flops = planner.train_step_flops(cfg.model, batch=rows, seq_len=T, attention=cfg.attention)
    mask = mask_bytes(cfg, rows, T)
    out = {"padding_fraction": packing.padding_fraction(sizes, rows, T), "num_rows": rows,
           "document_tokens": sum(sizes), "attention_pairs": predicted_pairs(cfg, sizes),
           "documents_isolated": float(cfg.variant != "packed_naive"),
           "speedup": pad_rows * pad_T / (rows * T), "peak_mem_bytes": plan.total_bytes + mask,
           "activation_bytes": plan.activation_bytes + mask, "flops": flops}
    peak = hardware.peak_tflops(cfg.device, num_threads=cfg.num_threads).get(cfg.dtype)
    if peak:
        out["useful_tokens_per_s"] = sum(sizes) / (flops / (peak * 1e12))
    return out


def shape(cfg: Config, lengths: list[int], variant: str | None = None) -> tuple[int, int]:
    """(rows, T): one row per document at the longest (padded), or an ideal packing's rows of
    seq_len (packed)."""
    if layout(variant or cfg.variant) == "padded":
        return len(lengths), max(lengths)
    return packing.packed_rows(lengths, cfg.seq_len), cfg.seq_len


def predicted_pairs(cfg: Config, lengths: list[int]) -> int:
    """Pairs the documents' tokens attend to: sum of L(L+1)/2 with each document alone (padded,
    packed); without a document mask each token also sees every token before its document in
    its row (first-fit decreasing's placement), so a document at offset o adds L x o."""
    if cfg.variant != "packed_naive":
        return packing.document_pairs(lengths)
    total = 0
    for row in packing.first_fit(lengths, cfg.seq_len):
        offset = 0
        for i in row:
            total += packing.causal_pairs(lengths[i]) + lengths[i] * offset
            offset += lengths[i]
    return total


def mask_bytes(cfg: Config, rows: int, T: int) -> int:
    """What the document mask adds to a step (packed only): the (rows, 1, T, T) bool mask and
    the float copy SDPA makes of it in each layer, saved for its backward (CPU's SDPA)."""
    if cfg.variant != "packed":
        return 0
    return rows * T * T * (1 + 4 * cfg.model.num_layers)


def notes(cfg: Config) -> dict[str, str]:
    out = {"padding_fraction": "pad tokens / tokens computed, counted in the batch; predicted from the "
                               "lengths: 1 - sum(L) / (rows x T), packed at ceil(sum(L) / seq_len) rows "
                               "(first-fit decreasing may need one more).",
           "useful_tokens_per_s": "document tokens per second of a training step (forward, backward, "
                                  "AdamW); predicted: the step's FLOPs at the device's peak (a bound).",
           "speedup": "padded's step time / this one's, timed alternately on the same weights; "
                      "predicted: padded's tokens computed / these, as if time followed tokens.",
           "peak_mem_bytes": "predicted: the planner's step at the rows x T of this layout."}
    rows, T = shape(cfg, lengths(cfg))
    out["attention_pairs"] = ("(query, key) pairs the step's mask lets through for document tokens, "
                              "counted in the mask; predicted: sum of L(L+1)/2, each document alone.")
    if cfg.variant == "packed":
        out["attention_pairs"] += (
            f" SDPA with a dense boolean mask still scores all rows x T^2 = {rows * T * T:,} pairs "
            "on the CPU (the mask only hides them): the residual between this count and the step "
            "time. FlexAttention's block mask or a varlen flash-attention kernel skips the hidden "
            "blocks.")
        out["peak_mem_bytes"] += (" Plus the mask: rows x T^2 bytes (bool) and SDPA's float copy "
                                  "of it saved in every layer, 4 rows x T^2 bytes each.")
    elif cfg.variant == "packed_naive":
        out["attention_pairs"] = ("pairs the causal mask lets through for document tokens, counted: "
                                  "each also sees every earlier document in its row (predicted from "
                                  "first-fit decreasing's placement): the cross-document pairs are "
                                  "the leak.")
    if cfg.variant == "packed_naive":
        out["documents_isolated"] = ("0: the documents attended to each other (no document mask, "
                                     "positions running on): each document's loss is not its own.")
    return out


# --- per document: the figure's table ----------------------------------------------------------------

def document_loss_table(cfg: Config):
    """A DataFrame, one row per document: its length and its mean loss under each variant, from
    one forward of each layout on the same seeded weights (nothing timed)."""
    import pandas as pd

    trainer, batch = packing_step(cfg, REFERENCE)
    table = pd.DataFrame({"document": range(len(batch.lengths)), "length": batch.lengths})
    for variant in VARIANTS:
        batch = batch_of(cfg, variant)
        table[variant] = document_losses(trainer.model, batch, cfg.device, variant == "packed")
    return table
