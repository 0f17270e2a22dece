"""A decoder cut into pipeline stage modules, where to cut it, and what a stage's step holds.

- `StageModule`: blocks [lo, hi) of a decoder; the first adds the embedding, the last the final
  norm and the head.
- `measure_costs` / `balance`: the cut that makes the slowest stage module fastest, from measured
  costs of the embedding, a block and the head + loss.
- `Spans`: compute spans on the host's clock, per step (the measured bubble's input).
- `TimedStage`: a PipelineStage that records its compute and what it holds, with injected faults.
- `bubble_metrics`: the bubble of the fastest step from every rank's spans.
- `SavedBytes`: the peak bytes autograd holds saved for backward while a schedule runs.
"""
from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage

from labkit.blocks.model import rope_tables
from labkit.blocks.pipeline_schedule import step_bubbles
from labkit.blocks.training import lm_loss
from labkit.measure.clock import clock, repeat_seconds
from labkit.measure.modes import unmetered

COST_REPEATS = 5  # timed runs per cost probe, after one warm-up
CORRUPTION = 1e-3  # relative error of a corrupted handoff: far above the check's tolerances


class StageModule(nn.Module):
    """Blocks [lo, hi) of a decoder; the first stage adds the embedding, the last the final norm
    and the head. tokens (b, T) or hidden (b, T, d) -> hidden (b, T, d) or logits (b, T, vocab)."""

    def __init__(self, model: nn.Module, lo: int, hi: int, *, first: bool, last: bool):
        super().__init__()
        self.cfg, self.attention = model.cfg, model.attention
        self.embed = model.embed if first else None
        self.pos_embed = model.pos_embed if first else None
        self.layers = model.layers[lo:hi]
        self.norm, self.lm_head = (model.norm, model.lm_head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        if self.embed is not None:
            x = self.embed(x)
            if self.pos_embed is not None:
                x = x + self.pos_embed(positions)
        rope = None if self.cfg.arch == "gpt2" else rope_tables(
            positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_llama3)
        for layer in self.layers:
            x = layer(x, 0, None, self.attention, rope)
        return x if self.lm_head is None else self.lm_head(self.norm(x))


# --- where to cut: measured cost per part, then the split that balances the stages -------------

def _fastest_ms(fn, device: str) -> float:
    """The fastest of COST_REPEATS runs after a warm-up: noise on a shared host only adds time."""
    return min(repeat_seconds(fn, device=device, repeats=COST_REPEATS, warmup=1)) * 1e3


def measure_costs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                  device: str) -> dict[str, float]:
    """ms for a forward + backward of the embedding, one block, and the norm + head + loss, on one
    micro-batch (tokens (b/m, T)). Timed outside the harness's memory tracker: a dispatch mode
    that roughly doubles a block's many small ops but not the head's one large matmul."""
    stage = StageModule(model, 0, 1, first=False, last=False)
    x = model.embed(tokens).detach().requires_grad_()  # (b/m, T, d)
    probes = {"embed": lambda: model.embed(tokens).sum().backward(),
              "block": lambda: stage(x).sum().backward(),
              "head": lambda: lm_loss(model.lm_head(model.norm(x)), targets).backward()}
    with unmetered():
        costs = {part: _fastest_ms(fn, device) for part, fn in probes.items()}
    model.zero_grad(set_to_none=True)  # the probes' gradients must not reach the check
    return costs


def agreed_costs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                 device: str) -> dict[str, float]:
    """Rank 0 measures (the others wait, leaving it the CPU) and every rank gets its figures:
    ranks that timed for themselves could cut the model differently."""
    costs = [measure_costs(model, tokens, targets, device) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(costs, src=0)
    return costs[0]


def stage_cost(costs: dict[str, float], i: int, n: int, blocks: int) -> float:
    """ms of stage module i of n: its blocks, the embedding on the first, the head on the last."""
    ends = (costs["embed"] if i == 0 else 0) + (costs["head"] if i == n - 1 else 0)
    return blocks * costs["block"] + ends


def balance(costs: dict[str, float], num_layers: int, n: int) -> list[int]:
    """Boundaries [0, b_1, ..., b_{n-1}, L]: stage module i runs blocks [b_i, b_{i+1}). Minimises
    the slowest module's cost; every middle module runs at least one block (the first may be
    the embedding alone, the last the head alone), so num_layers >= n - 2."""
    @functools.cache
    def best(i: int, lo: int) -> tuple[float, tuple[int, ...]]:
        if i == n - 1:
            return stage_cost(costs, i, n, num_layers - lo), (num_layers,)
        options = []
        # leave a block per middle module after this one; the first may take none
        for hi in range(lo + (i > 0), num_layers - max(0, n - 2 - i) + 1):
            rest, bounds = best(i + 1, hi)
            options.append((max(stage_cost(costs, i, n, hi - lo), rest), (hi,) + bounds))
        return min(options)
    return [0, *best(0, 0)[1]]


def min_layers(n: int) -> int:
    """Blocks a cut into n stage modules needs (`balance`): one per middle module."""
    return max(0, n - 2)


# --- what a step holds: compute spans, saved activations -----------------------------------------

class Spans:
    """Compute spans (start, end, cpu): seconds on the host's monotonic clock, and the seconds this
    thread ran on a CPU meanwhile (torch runs one intra-op thread per rank), one list per step."""

    def __init__(self, device: str):
        self.device, self.steps = device, []

    @contextlib.contextmanager
    def timed(self, simulated: bool = False):
        """`simulated`: an injected sleep, busy by definition (it stands for compute)."""
        # clock() synchronises a GPU: the span is the kernels' time, not their launch
        start, cpu = clock(self.device), time.thread_time()
        yield
        end = clock(self.device)
        self.steps[-1].append((start, end, end - start if simulated else time.thread_time() - cpu))


class TimedStage(PipelineStage):
    """A PipelineStage that records when it computes and how many micro-batches it holds for
    backward (`held`, shared by a rank's modules), and, when told, sleeps in every forward (an
    injected slow stage), sends every activation or gradient CORRUPTION too large, or drops
    micro-batch 0's W (`corrupt`: bugs the check must catch)."""

    def __init__(self, *args, spans: Spans, held: list[int], delay_s: float = 0.0,
                 corrupt: str = "none", **kwargs):
        super().__init__(*args, **kwargs)
        self.spans, self.held, self.delay_s, self.corrupt = spans, held, delay_s, corrupt

    def _hold(self, change: int) -> None:
        self.held[0] += change  # [now, peak]
        self.held[1] = max(self.held)

    def forward_one_chunk(self, *args, **kwargs):
        if self.delay_s:
            with self.spans.timed(simulated=True):
                time.sleep(self.delay_s)
        with self.spans.timed():
            out = super().forward_one_chunk(*args, **kwargs)
        self._hold(1)
        return out

    def backward_one_chunk(self, *args, full_backward: bool = True, **kwargs):
        with self.spans.timed():
            out = super().backward_one_chunk(*args, full_backward=full_backward, **kwargs)
        self._hold(-1 if full_backward else 0)  # a split backward holds the graph until its W
        return out

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward=False):
        if self.corrupt == "skip_w" and bwd_chunk_id == 0:
            return None  # the bug: micro-batch 0's weight gradients never accumulate
        with self.spans.timed():
            out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
        self._hold(-1)
        return out

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._maybe_corrupt(super().get_fwd_send_ops(fwd_chunk_id), "activation")

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._maybe_corrupt(super().get_bwd_send_ops(bwd_chunk_id), "gradient")

    def _maybe_corrupt(self, ops: list[dist.P2POp], kind: str) -> list[dist.P2POp]:
        """Copies (this stage's own autograd stays intact): a gradient scaled, which scales every
        earlier gradient alike; an activation shifted, since a scale would pass unseen through
        the next stage's RMSNorm where that stage is the head alone."""
        for op in ops if self.corrupt == kind else ():
            t = op.tensor
            op.tensor = (t * (1 + CORRUPTION) if kind == "gradient"
                         else t + CORRUPTION * t.abs().mean())
        return ops


def bubble_metrics(every: list[list[list[tuple[float, float, float]]]], r: int) -> dict[str, float]:
    """every[rank][step] = that rank's spans in that step. Per step: bubble_r = 1 - busy_r / wall.
    Reported for the fastest step: on a shared host another process can only stall a stage, which
    counts as busy on that rank and as wait on the others, pushing the bubble towards (p-1)/p; the
    fastest step was stalled least. `stall_fraction`: the share of a rank's compute spans its
    thread spent off the CPU (another process had the core); where it is more than a few percent
    the bubble measures the host."""
    steps = []
    for spans in zip(*every):  # one step, all ranks
        wall, busy = step_bubbles(list(spans))
        stall = [1 - sum(cpu for *_, cpu in rank) / b for rank, b in zip(spans, busy)]
        steps.append((wall, busy, stall))
    wall, busy, stall = min(steps)
    bubble = [1 - b / wall for b in busy]
    return {"bubble_fraction": bubble[r], "bubble_fraction_mean": sum(bubble) / len(bubble),
            "schedule_wall_ms": wall * 1e3, "stage_busy_ms": busy[r] * 1e3,
            "stall_fraction": stall[r], "stall_fraction_max": max(stall)}
