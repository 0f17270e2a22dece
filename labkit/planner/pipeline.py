"""Pipeline schedules: the bubble and the micro-batches in flight, per rank, for p ranks, m
micro-batches and v stage modules per rank.

Two conventions for the bubble, both here: the *fraction* of the step a rank idles (what
labkit measures, 1 - busy / wall; GPipe's (p-1)/(m+p-1)), and the *ratio* of idle time to the
ideal compute time m·(t_F + t_B) (the papers' (p-1)/m, (p-1)/(v·m)); fraction = ratio / (1 +
ratio). Each formula names its source; those marked "replayed" were read off torch 2.13's own
action lists (`labkit.blocks.pipeline_schedule.torch_orders`) replayed on equal stages with free
handoffs, and the tests hold every one to that replay.
"""
from __future__ import annotations

from labkit.config import ConfigError, ModelConfig
from labkit.planner.activations import _embedding_side_bytes, _head_bytes, _layer_bytes_per_token
from labkit.planner.plan import _resolve

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv")


def fraction_of_ratio(ratio: float) -> float:
    """Bubble time over ideal compute -> the share of the step spent idle."""
    return ratio / (1 + ratio)


def gpipe_bubble_fraction(p: int, m: int) -> float:
    """(p-1)/(m+p-1) of the step, GPipe and 1F1B alike with equal stages and free handoffs
    (Huang et al. 2019, "GPipe", section 2.3: ratio (p-1)/m; Narayanan et al. 2021,
    arXiv 2104.04473, section 2.2.1, for 1F1B)."""
    return (p - 1) / (m + p - 1)


def interleaved_bubble_fraction(p: int, m: int, v: int) -> float:
    """(p-1)/(v·m + p-1) of the step: the interleaved (looped) 1F1B with v stage modules per rank
    (Narayanan et al. 2021, arXiv 2104.04473, section 2.2.2: the bubble shrinks v times, ratio
    (p-1)/(v·m)). Replayed: torch's ScheduleInterleaved1F1B realises it for every m >= p it
    accepts (m a multiple of max(1, m // p))."""
    return fraction_of_ratio((p - 1) / (v * m))


def zero_bubble_idle(p: int, t_f: float, t_i: float, t_w: float) -> float:
    """Seconds each rank idles in a step of the zero-bubble schedule ZB-H1 (ZB1P), with t_f,
    t_i, t_w one stage module's forward, input-gradient backward (the paper's B) and weight-
    gradient backward: (p-1)·(t_F + t_B - t_W) (Qi et al. 2024, arXiv 2401.10241, table 1;
    1F1B's is (p-1)·(t_F + t_B + t_W)), at least (p-1)·max(t_F, t_B): the first forward and the
    last input-gradient still cross p-1 stages in turn. Replayed: torch's
    ScheduleInterleavedZeroBubble realises it at every v for m >= p."""
    return (p - 1) * max(t_f, t_i, t_f + t_i - t_w)


def zero_bubble_fraction(p: int, m: int, v: int = 1, t_f: float = 1.0, t_i: float = 1.0,
                         t_w: float = 1.0) -> float:
    """ZB1P's share of the step idle, v stage modules per rank, times per module
    (`zero_bubble_idle`). With t_F = t_B = t_W: ratio (p-1)/(3·v·m), a third of 1F1B's at v = 1
    (sail-sg/zero-bubble-pipeline-parallelism's README table)."""
    idle = zero_bubble_idle(p, t_f, t_i, t_w)
    return idle / (idle + v * m * (t_f + t_i + t_w))


def zbv_bubble_fraction(p: int, m: int) -> float:
    """(p-1)/(6m + p-1) of the step: torch's ScheduleZBVZeroBubble (2 stage modules per rank in a
    V, Qi et al. 2024 section 6) with t_F = t_B = t_W per module. Replayed: each rank idles
    (p-1)·t_F, a module's forward, for every m >= 2p-1 (fewer leave the V unfilled): half ZB1P's
    at v = 1, not the zero of the paper's hand-tuned ZB-V."""
    return (p - 1) / (6 * m + p - 1)


def ideal_bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Each schedule's bubble with equal stage modules, t_F = t_B(input) = t_W, free handoffs."""
    if schedule in ("gpipe", "1f1b"):
        return gpipe_bubble_fraction(p, m)
    if schedule == "interleaved_1f1b":
        return interleaved_bubble_fraction(p, m, v)
    if schedule == "zero_bubble":
        return zero_bubble_fraction(p, m, v)
    if schedule == "zbv":
        return zbv_bubble_fraction(p, m)
    raise ConfigError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")


def in_flight_micro_batches(schedule: str, p: int, m: int, rank: int, v: int = 1) -> int:
    """Micro-batches rank `rank` holds saved for backward at its peak, counted per stage module
    (a rank with v modules holding k micro-batches on each counts v·k):
    - GPipe: all m (Huang et al. 2019);
    - 1F1B: min(m, p - rank) (Narayanan et al. 2021 section 2.2.1: p on the first stage);
    - interleaved: min(v·m, (v-1)·m_r + 2(p-1-rank) + 1), m_r = m / max(1, m // p) the
      micro-batches per round: torch's warm-up forwards plus one (more than 1F1B's v·(p-rank));
    - ZB1P: min(v·m, (v-1)·m_r + p): the W of a micro-batch waits rank steps, so every rank
      holds p at v = 1 (Qi et al. 2024: ZB-H1's peak is 1F1B's first stage's, p);
    - ZBV: 2p modules' worth, p whole stages, on every rank for m >= 2p-1 (Qi et al. 2024,
      section 6: 1F1B's peak; sail-sg's table: 1x).
    The interleaved and ZB1P counts are replayed from torch's orders; the tests hold all five."""
    m_r = m // max(1, m // p)
    counts = {"gpipe": lambda: m, "1f1b": lambda: min(m, p - rank),
              "interleaved_1f1b": lambda: min(v * m, (v - 1) * m_r + 2 * (p - 1 - rank) + 1),
              "zero_bubble": lambda: min(v * m, (v - 1) * m_r + p),
              "zbv": lambda: min(2 * m, 2 * p)}
    if schedule not in counts:
        raise ConfigError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")
    return counts[schedule]()


def handoffs_per_micro_batch(schedule: str, p: int, rank: int, v: int = 1) -> int:
    """Tensors rank `rank` sends per micro-batch: an activation forward for each of its modules
    whose next module is on another rank, a gradient back for each whose previous one is.
    - one module per rank (GPipe, 1F1B, ZB1P at v = 1): [rank < p-1] + [rank > 0];
    - looped over v modules: 2v - [rank = p-1] - [rank = 0], v times 1F1B's: a micro-batch
      crosses p·v - 1 boundaries each way, not p - 1 (Narayanan et al. 2021 section 2.2.2);
    - ZBV: 2·([rank > 0] + [rank < p-1]): the V's turn (modules p-1 and p) stays on rank p-1,
      every other boundary is crossed (sail-sg's table: 2x 1F1B's volume; 2p - 2 crossings each way)."""
    inner = (rank < p - 1) + (rank > 0)
    if schedule == "zbv":
        return 2 * inner
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        return 2 * v - (rank == p - 1) - (rank == 0)
    if schedule in ("gpipe", "1f1b"):
        return inner
    raise ConfigError(f"unknown schedule {schedule!r}; valid: {', '.join(SCHEDULES)}")


def pipeline_sent_bytes(schedule: str, p: int, m: int, rank: int, *, v: int = 1, batch_size: int,
                        seq_len: int, hidden_size: int, dtype_bytes: int = 4) -> int:
    """Bytes rank `rank` sends in one step: m micro-batches times `handoffs_per_micro_batch`
    tensors of (batch_size, seq_len, hidden_size) each (an activation and its gradient are the
    same size); batch_size is a micro-batch's rows."""
    return m * handoffs_per_micro_batch(schedule, p, rank, v) * batch_size * seq_len * hidden_size * dtype_bytes


def zb_h2_in_flight(p: int) -> int:
    """ZB-H2's peak, micro-batches per rank: 2p - 1, for a bubble of (p-1)·(t_F + t_B - 2·t_W),
    zero when t_W >= (t_F + t_B)/2 (Qi et al. 2024, table 1; sail-sg's table: 2x of 1F1B).
    torch 2.13 has no ZB-H2 schedule: a formula to compare, not a variant."""
    return 2 * p - 1


def stage_activation_bytes(m: ModelConfig, *, batch_size: int, seq_len: int, blocks: int,
                           first: bool, last: bool) -> int:
    """Bytes one stage module keeps for backward per micro-batch of (batch_size, seq_len), fp32:
    its blocks (`layer_activation_bytes` each); the embedding side (`_embedding_side_bytes`):
    Llama's RoPE tables on every module with blocks (each builds its own: p·v copies where one
    model keeps one), GPT-2's positions on the first; on the last the final norm, the
    log-probabilities and the loss's targets (`_head_bytes`), whose 8-byte copy per token is
    made only where the micro-batch's rows are a strided view of the batch (batch_size > 1):
    one row is a contiguous view, the batch's ids (`pipeline_token_bytes`)."""
    r = _resolve(m, batch_size=batch_size, seq_len=seq_len, precision="fp32", device="cpu")
    total = blocks * batch_size * seq_len * _layer_bytes_per_token(r, "none")
    side = blocks > 0 if m.arch == "llama" else first
    head = _head_bytes(r) - (8 * seq_len if batch_size == 1 else 0) if last else 0
    return total + (_embedding_side_bytes(r) if side else 0) + head


def loss_activation_bytes(m: ModelConfig, *, batch_size: int, seq_len: int) -> int:
    """The last module's loss share of `stage_activation_bytes`: cross-entropy's fp32
    log-probabilities, the targets' copy (none for a one-row micro-batch) and the fp32
    total_weight. A split backward frees it at the I, not the W: torch's stage_backward_input
    detaches the loss, and nothing above the head's weight is needed for the weights' gradient."""
    tokens = batch_size * seq_len
    return tokens * (4 * m.vocab_size + (8 if batch_size > 1 else 0)) + 4


def pipeline_token_bytes(batch_size: int, seq_len: int) -> int:
    """The batch's int64 ids, (B, T+1), of which inputs and targets are shifted views: 8·B·(T+1)
    bytes, held once while the first module's embedding keeps a micro-batch's inputs, or the
    last's loss a one-row micro-batch's targets (the same storage on one rank: once)."""
    return 8 * batch_size * (seq_len + 1)
