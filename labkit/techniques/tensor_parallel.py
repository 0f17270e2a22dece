"""Tensor parallelism: Megatron's column/row split of attention and MLP, with DTensor.

Every rank holds 1/n of each block's big matrices: wq, wk, wv, w1, w3 split by output columns
(`ColwiseParallel`: each rank computes its own heads and its slice of the MLP's inner width, no
communication), wo and w2 split by input rows (`RowwiseParallel`: each rank's partial product is
summed across ranks). The embedding is split by vocabulary rows and the head by vocabulary columns
(Megatron's vocab-parallel layers), so a rank's parameters are `planner.stage_params(m, tp=n)`.

- `single` (the reference): the plain model on every rank, no collectives.
- `tp`: the residual stream is replicated; per layer the forward all-reduces the outputs of wo and
  w2 (Megatron's "g") and the backward all-reduces the gradients of the attention and MLP inputs
  ("f"): 4 all-reduces of b*s*h elements per layer and step.
- `tp_sp`: sequence parallel (Korthikanti et al. 2022): between the blocks the residual stream is
  split along the sequence, the norms run on 1/n of the tokens (`SequenceParallel`), and each
  all-reduce becomes an all-gather before the split matmuls and a reduce-scatter after them. The
  same bytes cross the links (an all-reduce is a reduce-scatter plus an all-gather); activations
  outside the matmuls shrink by n. The norm weights stay replicated; their gradients, each rank's
  over its own tokens, are summed once after backward (Megatron does the same).

The transform comes from outside, gpt-fast style: `transforms.apply_tensor_parallel(trainer, mesh)`
rewrites the plain decoder's parameters into DTensor shards; `Attention` views its projections as
(B, T, -1, hd), so it runs unchanged on its local heads. The order (`build_sharded_step`, in
`labkit.blocks.sharded` with the rest of the sharded step hybrid shares): the plain step with its
optimizer deferred, the transform, then the optimizer built (it must see the sharded parameters).
Outputs are the logits (gathered on every rank) and gradients gathered with `full_tensor()`; both
must equal the reference's at fp32 precision.
Under `fault=corrupt_reduction` fault_rank scales its partial products of wo and w2 before they
are summed across ranks (Megatron's "g"), and that check must fail.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass

from typing import Callable

import numpy as np

from labkit import planner
from labkit.config import knob
from labkit.blocks.distributed import DistConfig, corrupt_scale, default_nproc, world_size
from labkit.blocks.layout import Layout
from labkit.measure.comm import COLLECTIVES, CommCounter
from labkit.measure.memory import ActivationMeter
from labkit.blocks.sharded import (TP_TOLERANCE as TOLERANCE, backward, build_sharded_step,
                                   check_tp_shape, corrupt_row_outputs, full_grads, grads, train_step)
from labkit.blocks.training import Trainer, compare_grads, lm_loss, optimizer_state
from labkit.blocks.transforms import apply_tensor_parallel
from labkit.workload import Comparison, Workload

DISTRIBUTED = True
VARIANTS = ("single", "tp", "tp_sp")
REFERENCE = "single"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"timed_steps": 3, "seq_len": 32}, {"timed_steps": 2, "seq_len": 32, "num_layers": 2},
             {"timed_steps": 2, "seq_len": 32, "num_layers": 1})



@dataclass(kw_only=True)
class Config(DistConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="plain model, tensor parallel, + sequence parallel")
    reduction_fault = True  # see corrupt_row_outputs


def tp_degree(cfg: DistConfig) -> int:
    """n: every rank is one tensor-parallel shard (nproc is the world size once resolved)."""
    return cfg.nproc or default_nproc(cfg.device)


def validate(cfg: Config) -> None:
    check_tp_shape(cfg, tp_degree(cfg))


def skip_reason(cfg: Config) -> str | None:
    n = tp_degree(cfg)
    if cfg.variant == "tp_sp" and cfg.seq_len % n:
        return f"sequence parallel splits seq_len={cfg.seq_len} into {n} equal pieces: use a multiple of {n}"
    return None


def comm_formula(cfg: DistConfig, variant: str, n: int) -> dict[str, float]:
    """The collectives of one step (forward + backward), Megatron's count. tp: per layer 2
    all-reduces of b*s*h forward and 2 backward, the embedding's 1 forward and the head's 1
    backward (4L + 2), and 1 all-gather of the b*s*V logits. tp_sp: each of those all-reduces an
    all-gather + reduce-scatter pair, and the norm weights' gradients (2L + 1 of h) all-reduced.
    fp32: 4 bytes an element; `comm_bus_bytes` with a ring's factors."""
    m, L = cfg.model, cfg.model.num_layers
    if variant == REFERENCE or n == 1:
        return _comm_rows(dict.fromkeys(COLLECTIVES, 0), 0, 0)
    tokens = cfg.batch_size * cfg.seq_len
    bsh, bsv, norms = 4 * tokens * m.hidden_size, 4 * tokens * m.vocab_size, 4 * (2 * L + 1) * m.hidden_size
    pairs, ring = 4 * L + 2, (n - 1) / n
    if variant == "tp":
        counts = {"all_reduce": pairs, "all_gather": 1, "reduce_scatter": 0}
        return _comm_rows(counts, pairs * bsh + bsv, (2 * pairs * bsh + bsv) * ring)
    counts = {"all_reduce": 2 * L + 1, "all_gather": pairs + 1, "reduce_scatter": pairs}
    return _comm_rows(counts, 2 * pairs * bsh + bsv + norms, (2 * pairs * bsh + bsv + 2 * norms) * ring)


def _comm_rows(counts: dict[str, int], total: float, bus: float) -> dict[str, float]:
    return {**{f"{c}_count": float(k) for c, k in counts.items()}, "comm_bytes": float(total),
            "comm_bus_bytes": float(bus)}


# --- the experiment ---------------------------------------------------------------------------


def check_step(trainer: Trainer, measured: dict[str, float]) -> dict:
    """One training step: logits, loss and whole gradients; the collectives of its forward and
    backward counted into `measured` (AdamW on local shards communicates nothing), and what its
    forward leaves held for backward (`activation_bytes`)."""
    trainer.drop_grads()
    with CommCounter() as counter, warnings.catch_warnings():
        # CommDebugMode's module tracker hooks the embedding, whose token ids need no grad
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        out: list = []
        meter = ActivationMeter(trainer.model.parameters()).measure(lambda: out.append(forward(trainer)) or out[0])
        logits, loss = out[0]
        backward(trainer, loss)
    measured.update(counter.metrics(), activation_bytes=meter.total_bytes)
    out = {"loss": loss.item(), "logits": logits.detach().cpu().numpy().copy(),
           "grads": full_grads(trainer.model)}
    trainer.update()
    return out


def forward(trainer: Trainer) -> tuple:
    """(logits (B, T, V), replicated on every rank; the loss)."""
    logits = trainer.model(trainer.inputs)
    return logits, lm_loss(logits, trainer.targets)


def sharding(cfg: Config, n: int) -> Callable[[Trainer], Trainer]:
    """The transform of the variant's step: `apply_tensor_parallel` over n ranks, after
    (fault=corrupt_reduction) the corrupting hooks, registered first so that they see the
    unreduced outputs."""
    mesh = Layout(tp=n, device=cfg.device, always=("tp",)).tp_mesh
    scale = corrupt_scale(cfg)

    def apply(trainer: Trainer) -> Trainer:
        if scale is not None:
            corrupt_row_outputs(trainer.model, scale)
        return apply_tensor_parallel(trainer, mesh, sequence_parallel=cfg.variant == "tp_sp")
    return apply


def build(cfg: Config) -> Workload:
    n = world_size()
    check_tp_shape(cfg, n)
    trainer = build_sharded_step(cfg, None if cfg.variant == REFERENCE else sharding(cfg, n))
    measured: dict[str, float] = {}  # counted in check(): collectives, gradient bytes
    return Workload(step=functools.partial(train_step, trainer),
                    check=functools.partial(check_step, trainer, measured),
                    tokens_per_step=cfg.batch_size * cfg.seq_len,
                    tensors={"param_bytes": trainer.model.parameters,
                             "grad_bytes": functools.partial(grads, trainer),
                             "optimizer_bytes": lambda: optimizer_state(trainer.optimizer)},
                    report=lambda: dict(measured), notes=notes(cfg), count_flops=False,
                    compute_dtype=cfg.dtype)


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Logits and every gradient of one step against the plain model's."""
    logits = float(np.abs(outputs["logits"].astype(np.float64) - reference["logits"]).max())
    loss_diff = abs(outputs["loss"] - reference["loss"])  # shown; the logits are checked
    return compare_grads(reference, outputs, TOLERANCE, extra={"logits_max_abs_diff": logits},
                         reported={"loss": outputs["loss"], "loss_abs_diff": loss_diff})


def expected(cfg: Config) -> dict[str, float]:
    n = 1 if cfg.variant == REFERENCE else tp_degree(cfg)
    params = planner.stage_params(cfg.model, tp=n).total  # this rank's shard of every tensor
    return {"param_bytes": 4.0 * params, "grad_bytes": 4.0 * params,
            "optimizer_bytes": 8.0 * params,  # AdamW: m and v, fp32
            "loss_abs_diff": 0.0, "logits_max_abs_diff": 0.0, "grad_max_rel_diff": 0.0,
            **comm_formula(cfg, cfg.variant, n), **activation_formula(cfg, n)}


def activation_formula(cfg: Config, n: int) -> dict[str, float]:
    """What the forward keeps for backward on one rank (fp32 runs): the planner's blocks with
    their head- and f-wide terms divided by n, and with sequence parallelism (tp_sp) each block
    norm's saved tensors for its seq_len / n tokens alone."""
    if cfg.dtype != "float32" or cfg.seq_len % n:
        return {}
    plan = planner.training_memory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len, tp=n,
                                   gpus=n, device=cfg.device, sequence_parallel=cfg.variant == "tp_sp")
    return {"activation_bytes": float(plan.activation_bytes)}


def notes(cfg: Config) -> dict[str, str]:
    return {"param_bytes": "predicted: planner.stage_params(tp=n) x 4 bytes (heads, MLP width and "
                           "vocabulary split; norms replicated).",
            "grad_bytes": "at rest after the step, each laid out as its parameter (match_grad_placements).",
            "optimizer_bytes": "predicted: AdamW's two fp32 moments of the local shard (the "
                               "per-tensor step counters, 4 bytes each, are left out).",
            "activation_bytes": "what the forward and the loss leave held for backward on this rank "
                                "(ActivationMeter). predicted: planner.training_memory(tp=n, "
                                "sequence_parallel for tp_sp): under tp_sp each block's two norms "
                                "keep their saved tensors for seq_len / n tokens; the final norm's "
                                "saving is not predicted (DTensor keeps tensors there that autograd "
                                "did not save).",
            "comm_bytes": "forward + backward of one step; S per collective as nccl-tests "
                          "defines it. predicted: Megatron's count (see comm_formula).",
            "comm_bus_bytes": "bytes through each rank's busiest link with a ring: the same for tp "
                              "and tp_sp (an all-reduce is a reduce-scatter plus an all-gather) but "
                              "for tp_sp's 2L + 1 norm-weight gradients."}
