"""CPU offload: keep activations and/or the optimizer state in host memory while training.

- `none` (the reference): everything on the device.
- `activations`: what autograd saves for backward goes to pinned host memory as the forward makes
  it (`torch.autograd.graph.save_on_cpu(pin_memory=True)`) and comes back in backward. The weights
  that matmuls save stay where they are: they are resident anyway, and copying them would only
  add traffic.
- `optimizer`: AdamW's moments, and the fp32 copy of the weights it updates, live on the host.
  Each step copies the gradients down, updates on the CPU, and copies the weights back up.
- `both`.
Offloading moves bytes; it must not change numbers: the losses and the gradient norm equal the
reference's. What it buys is device memory, and what it costs is the time of the copies
(bytes moved / the host link's bandwidth, measured here) plus, for the optimizer, the host's AdamW.
Only a GPU has device memory to save: on the CPU the variants are skipped and the reference runs,
unless a virtual memory budget (`memory_budget_gib`) stands for a GPU's memory: then the host copies
are kept outside the budget's live-tensor tracker (`labkit.measure.modes.unmetered`), as host memory
is outside a GPU's, and the peak shows what offloading saves of the budget (not of the CPU's RAM).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from labkit import hardware, planner
from labkit.config import RunConfig, knob
from labkit.measure.clock import CudaSpan
from labkit.blocks.training import CopyAdamW, Trainer
from labkit.blocks.transforms import apply_offload
from labkit.workload import Comparison, Workload

VARIANTS = ("none", "activations", "optimizer", "both")
REFERENCE = "none"
# smaller sizes of the default CPU run, cheapest last (labkit.harness.budget)
CPU_RUNGS = ({"batch_size": 2}, {"batch_size": 1, "seq_len": 32, "num_layers": 2})

# Relative difference of losses and gradient norm that still counts as equal. Not 0: on a GPU the
# reference is not bitwise reproducible itself (attention's backward accumulates with atomics), and
# the host's AdamW is the same math in other kernels. A wrong copy would be off by far more.
TOLERANCE = 1e-4
COPY_BYTES = 64 * 2**20  # per copy when measuring the host link
# Host AdamW per parameter and step: reads weight, grad and two moments, writes weight and
# moments, 7 x 4 bytes, at the host's memory bandwidth.
HOST_ADAMW_BYTES_PER_PARAM = 28


@dataclass(kw_only=True)
class Config(RunConfig):
    variant: str = knob(REFERENCE, choices=VARIANTS, help="what lives in host memory")
    steps: int = knob(3, min=1, help="training steps compared with the reference")
    lr: float = knob(1e-3, min=0.0, help="AdamW learning rate")


def offloads(variant: str) -> tuple[bool, bool]:
    """(activations offloaded, optimizer state offloaded)."""
    return variant in ("activations", "both"), variant in ("optimizer", "both")


def offload_step(cfg: Config) -> Trainer:
    """The plain training step with the variant's activations and optimizer state on the host
    (`apply_offload`)."""
    activations, optimizer = offloads(cfg.variant)
    trainer = Trainer(cfg, lr=cfg.lr, optimizer=False)
    apply_offload(trainer, activations=activations, optimizer=optimizer)
    trainer.build_optimizer()
    return trainer


def transfer_bytes(trainer: Trainer) -> int:
    """Bytes over the host link per step: saved tensors down and back up, then the optimizer's
    gradients down and weights up."""
    acts = 2 * trainer.host_hooks.bytes_to_host if trainer.host_hooks is not None else 0
    return acts + (trainer.optimizer.bytes_per_step if isinstance(trainer.optimizer, CopyAdamW) else 0)


@functools.lru_cache(maxsize=None)
def link_gbps(device: str) -> tuple[float, float]:
    """Measured (host -> device, device -> host) GB/s of pinned copies (CUDA events), once per
    device; this is what every offloaded byte pays."""
    with torch.cuda.device(device):
        host = torch.empty(COPY_BYTES, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
        return _copy_gbps(dev, host), _copy_gbps(host, dev)


def _copy_gbps(dst: torch.Tensor, src: torch.Tensor, repeats: int = 5) -> float:
    dst.copy_(src, non_blocking=True)  # warm-up
    with CudaSpan() as span:
        for _ in range(repeats):
            dst.copy_(src, non_blocking=True)
    return repeats * src.numel() / span.seconds / 1e9


def train_and_watch(trainer: Trainer, steps: int, device: str) -> dict:
    """`steps` steps (what `compare` checks). On CUDA also the device's peak and the last step's
    time (CUDA events, after the first step's allocations), which `compare` turns into memory
    saved and time added against the reference."""
    if not device.startswith("cuda"):
        return trainer.train(steps)
    with torch.cuda.device(device):
        torch.cuda.reset_peak_memory_stats(device)
        trainer.train(steps - 1)
        with CudaSpan() as span:
            out = trainer.train(1)
        last_step_ms = span.seconds * 1e3
    return {**out, "device_peak_bytes": torch.cuda.max_memory_allocated(device),
            "last_step_ms": last_step_ms}


def skip_reason(cfg: Config) -> str | None:
    if cfg.variant != REFERENCE and not cfg.device.startswith("cuda") and cfg.memory_budget_gib is None:
        return ("nothing to offload to: on the CPU the activations and the optimizer state already "
                "live in host memory, so there is no device memory to save (runs on a GPU, or "
                "on the CPU under a virtual memory_budget_gib)")
    return None


def build(cfg: Config) -> Workload:
    trainer = offload_step(cfg)
    cuda = cfg.device.startswith("cuda")

    def device_optimizer_tensors() -> list[torch.Tensor]:
        if offloads(cfg.variant)[1] and not cuda:  # the CPU's "host" copies: outside the budget
            return []
        return [t for t in trainer.optimizer_tensors() if t.device.type == torch.device(cfg.device).type]

    def report() -> dict[str, float]:
        if not cuda:
            return {}
        h2d, d2h = link_gbps(cfg.device)
        return {"transfer_bytes": transfer_bytes(trainer), "h2d_gbps": h2d, "d2h_gbps": d2h}

    return Workload(
        step=trainer.step, check=lambda: train_and_watch(trainer, cfg.steps, cfg.device),
        tokens_per_step=cfg.batch_size * cfg.seq_len,
        tensors={"param_bytes": trainer.model.parameters,
                 "optimizer_bytes": trainer.optimizer_tensors,
                 "device_optimizer_bytes": device_optimizer_tensors},
        forward=trainer.forward, resident=trainer.model.parameters, report=report,
        notes=notes(cfg))


def compare(reference: dict, outputs: dict, cfg: Config) -> Comparison:
    """Losses and gradient norm equal to the reference's; on a GPU also the device memory saved
    and the time added by the copies."""
    ref, got = reference["losses"], outputs["losses"]
    loss_delta = max(abs(a - b) for a, b in zip(ref, got))
    norm_delta = abs(outputs["grad_norm"] - reference["grad_norm"])
    ok = loss_delta <= TOLERANCE * abs(ref[-1]) and norm_delta <= TOLERANCE * reference["grad_norm"]
    metrics = {"loss_delta": loss_delta, "grad_norm_delta": norm_delta}
    if "device_peak_bytes" in outputs and "device_peak_bytes" in reference:
        metrics["device_mem_saved_bytes"] = reference["device_peak_bytes"] - outputs["device_peak_bytes"]
        metrics["added_step_ms"] = outputs["last_step_ms"] - reference["last_step_ms"]
    message = "" if ok else (f"loss off by {loss_delta:.3g}, gradient norm by {norm_delta:.3g} "
                             f"(tolerance {TOLERANCE:g} relative)")
    return Comparison(metrics, ok, message)


def expected(cfg: Config) -> dict[str, float]:
    """The planner's peak less what moved to the host; the copies' time at the measured link."""
    acts, opt = offloads(cfg.variant)
    plan = planner.training_memory(cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                   precision="fp32", device=torch.device(cfg.device).type)
    moved = (plan.activation_bytes if acts else 0) + (plan.optimizer_bytes if opt else 0)
    out = {"peak_mem_bytes": plan.total_bytes - moved, "loss_delta": 0.0, "grad_norm_delta": 0.0,
           "optimizer_bytes": planner.adamw_state_bytes(cfg.model, master_copy=opt),
           "device_optimizer_bytes": 0 if opt else plan.optimizer_bytes}
    if cfg.device.startswith("cuda"):
        h2d, d2h = link_gbps(cfg.device)
        down = (plan.activation_bytes if acts else 0) + (plan.grad_bytes if opt else 0)
        up = (plan.activation_bytes if acts else 0) + (plan.param_bytes if opt else 0)
        seconds = down / (d2h * 1e9) + up / (h2d * 1e9)
        if opt:
            host_gbps = hardware.bandwidth_gbps("cpu", num_threads=cfg.num_threads)
            seconds += HOST_ADAMW_BYTES_PER_PARAM * plan.num_params / (host_gbps * 1e9)
        out.update(transfer_bytes=down + up, added_step_ms=seconds * 1e3,
                   device_mem_saved_bytes=moved)
    return out


def notes(cfg: Config) -> dict[str, str]:
    acts, opt = offloads(cfg.variant)
    out = {"peak_mem_bytes": "device memory: the planner's peak less what lives on the host."
                             + ("" if cfg.device.startswith("cuda") else " On the CPU: the virtual "
                                "budget's tracked tensors; the host copies are kept outside it.")}
    if cfg.device.startswith("cuda"):
        out["added_step_ms"] = (
            "measured: the last of the check's steps (CUDA events) less the reference's; "
            "predicted: bytes moved each way over the measured pinned bandwidth"
            + (", plus the host AdamW's memory traffic at the CPU's bandwidth (at num_threads "
               "threads: raise it for a fast host update)" if opt else "") + ". The copies are "
            "not overlapped with compute here, so they add up.")
        out["transfer_bytes"] = ("per step: saved activations down in forward and up in backward "
                                 "(the weights stay); gradients down and weights up for the "
                                 "host optimizer.")
    if opt:
        out["optimizer_bytes"] = ("in host memory: AdamW's two fp32 moments plus the fp32 weights it "
                                  "updates (12 bytes per parameter); none on the device.")
    if acts:
        out["activation_bytes"] = "saved for backward, held in pinned host memory."
    return out
