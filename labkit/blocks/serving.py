"""A small serving engine: a workload's requests replayed against the real model in real time.

The engine owns the clock and the KV storage, a `BlockPool` holding `kv_budget_tokens`
positions. At every iteration a scheduler (a policy) chooses which waiting requests start and
which running ones give way; the new ones are prefilled, then every running sequence advances by
one token in one batched forward pass (a decode step). Nothing is simulated: each token is a
real forward pass and each time is read from the clock.

- Rows of different lengths share a batch: each row has its own start position (RoPE and the
  causal mask) and reads its own cache slots (`RowCache`); keys past a row's end are masked.
- Prefill: batch-at-a-time schedulers run the new prompts right-padded to the longest (the
  padding is computed, and counted as waste; each row's logits are read at its last real token);
  iteration-level ones prefill each new request on its own, without padding.
- Two ways to hold memory. Reservation (`static`, `dynamic`): a request takes a block of the
  longest possible length (prompt + output, unknown in advance) when it starts, so the budget
  fixes how many run at once. Paging (`continuous`, `priority`): blocks of `block_size` are taken
  as a sequence grows; when the pool runs dry a running sequence is preempted.
- Preemption is vLLM's recompute mode: the victim's blocks are freed and it waits again with the
  tokens it has produced; when resumed, its prompt and those tokens are prefilled again (counted
  as recomputed work) and decoding goes on where it stopped.
- Policies: `BatchPolicy` (static: the next `slots` requests in arrival order, started together
  once all have arrived, released together when the longest is done; dynamic: the same per
  prompt-length bucket, started when full or when its oldest request has waited `timeout_s`)
  and `IterationPolicy` (continuous: first come, first served at every step; priority: by class,
  preempting lower classes to make room).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from labkit.blocks.model import Decoder
from labkit.blocks.kv_caches import BlockPool
from labkit.blocks.requests import Request


@dataclass(eq=False)
class Sequence:
    """A request being served. `forced`: a continuation fed instead of the greedy tokens (the
    check mode: every scheduler then computes the same contexts, and their log-probabilities
    must agree). `rank`: its priority class's rank, 0 the most urgent."""

    req: Request
    prompt: list[int]
    forced: list[int] | None = None
    rank: int = 0
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top1: list[int] = field(default_factory=list)
    cached: int = 0  # positions held in the KV cache
    slot: int = -1
    first_token_s: float | None = None
    first_step: int | None = None  # the index (in the engine's steps) of the pass that made it
    finish_s: float | None = None
    preemptions: int = 0

    @property
    def done(self) -> bool:
        return len(self.out) >= self.req.output_len

    def text(self) -> list[int]:
        """What a prefill runs: the prompt, plus (when resumed) every produced token but the
        last, which the next decode step feeds."""
        return self.prompt + self.out[:-1]


@dataclass(frozen=True)
class Step:
    """One forward pass: `positions` computed, of which `padding` served no request and
    `recomputed` were redone after a preemption; `live` rows served a request."""

    kind: str  # prefill or decode
    start_s: float
    end_s: float
    rows: int
    live: int
    positions: int
    padding: int
    recomputed: int


@dataclass(frozen=True)
class Segment:
    """A request holding a slot from `start_s` to `end_s`: `served` (it ran), `held` (done, its
    slot kept until the batch ends) or `preempted`."""

    request: int
    priority: str
    slot: int
    start_s: float
    end_s: float
    state: str


class RowCache:
    """The model's cache slot for one forward pass over rows of different lengths in a pool: row b
    writes its new keys at slots `write[b]` (T,) and reads slots `read[b]` (S,), its positions
    0..S-1 (padded past its end with a slot the mask hides). The indices are flattened once; every
    layer uses them as they are."""

    def __init__(self, pool: BlockPool, write: torch.Tensor, read: torch.Tensor):
        self.pool, self.width = pool, read.shape[1]
        self.write, self.read = write.reshape(-1), read.reshape(-1)  # (B*T,), (B*S,)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, KV, T, hd = k.shape
        self.pool.put(layer, self.write, k.transpose(1, 2).reshape(B * T, KV, hd),
                      v.transpose(1, 2).reshape(B * T, KV, hd))
        k_all, v_all = self.pool.take(layer, self.read)  # (B*S, KV, hd)
        k_all = k_all.view(B, self.width, KV, hd).transpose(1, 2)  # (B, KV, S, hd)
        v_all = v_all.view(B, self.width, KV, hd).transpose(1, 2)
        if k_all.dtype != k.dtype:  # a cache stored in another dtype than the compute
            k_all, v_all = k_all.to(k.dtype), v_all.to(v.dtype)
        return k_all, v_all


class Engine:
    """Serves `seqs` (in arrival order) on `model` with `num_slots` rows at most and a pool of
    `num_blocks` blocks of `block_size` positions. `reserve`: tokens a sequence takes when it
    starts (the longest possible sequence for reservation; 0: paging, as it grows)."""

    def __init__(self, model: Decoder, seqs: list[Sequence], *, num_slots: int, num_blocks: int,
                 block_size: int, reserve: int, kv_dtype: torch.dtype, closed: bool = False):
        m, device = model.cfg, model.embed.weight.device
        self.model, self.seqs, self.reserve, self.closed = model, seqs, reserve, closed
        self.pool = BlockPool(num_layers=m.num_layers, num_blocks=num_blocks, block_size=block_size,
                              kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=kv_dtype,
                              device=device)
        self.free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out 0, 1, ...
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.steps: list[Step] = []
        self.segments: list[Segment] = []
        self.started: dict[Sequence, float] = {}
        self.t0 = 0.0
        self.idle_s = 0.0  # time spent waiting for an arrival or a timeout, nothing to run

    # --- the clock and the loop ------------------------------------------------------------------

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def arrival(self, s: Sequence) -> float:
        return 0.0 if self.closed else s.req.arrival_s

    @torch.inference_mode()
    def serve(self, policy: "Policy") -> "Engine":
        """Replay every request to the end; returns self (its steps, segments and sequences)."""
        pending = deque(self.seqs)
        self.t0 = time.perf_counter()
        while pending or self.waiting or self.running:
            while pending and self.arrival(pending[0]) <= self.now():
                self.waiting.append(pending.popleft())
            new = policy.admit(self, more_coming=bool(pending))
            if new:
                for group in [new] if policy.pad_prefill else [[s] for s in new]:
                    self.prefill(group)
                policy.release(self)
            if self.running:
                self.grow(policy)
                self.decode()
                policy.release(self)
            elif not new:
                wake = [t for t in (policy.wake_s(self),) if t is not None]
                wake += [self.arrival(pending[0])] if pending else []
                if not wake:
                    raise RuntimeError(f"{type(policy).__name__} cannot start any of "
                                       f"{len(self.waiting)} waiting requests")
                before = self.now()
                time.sleep(max(0.0, min(wake) - before))
                self.idle_s += self.now() - before
        return self

    # --- memory and slots ------------------------------------------------------------------------

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.pool.block_size)

    def fits(self, s: Sequence) -> bool:
        """A free slot, and blocks for its prefill and first decoded position."""
        need = self.blocks_for(max(self.reserve, len(s.text()) + 1))
        return bool(self.free_slots) and need <= self.pool.num_free_blocks

    def start(self, s: Sequence) -> None:
        self.pool.allocate(s.req.id, max(self.reserve, len(s.text()) + 1))
        s.slot = self.free_slots.pop()
        self.waiting.remove(s)
        self.running.append(s)
        self.started[s] = self.now()

    def stop(self, s: Sequence, state: str) -> None:
        """Free `s`'s slot and blocks; its segment ends now (`held` from when it finished)."""
        now = self.now()
        if state == "served" and s.finish_s is not None and now - s.finish_s > 1e-3:
            self.segments.append(self._segment(s, self.started[s], s.finish_s, "served"))
            self.segments.append(self._segment(s, s.finish_s, now, "held"))
        else:
            self.segments.append(self._segment(s, self.started[s], now, state))
        self.pool.free(s.req.id)
        self.free_slots.append(s.slot)
        self.running.remove(s)
        s.slot = -1

    def preempt(self, s: Sequence) -> None:
        self.stop(s, "preempted")
        s.cached, s.preemptions = 0, s.preemptions + 1
        self.waiting.append(s)

    def grow(self, policy: "Policy") -> None:
        """Every running sequence gets the block for its next position; when the pool is out,
        the policy's least urgent running sequence is preempted."""
        for s in sorted(self.running, key=policy.key):
            while s in self.running:
                try:
                    self.pool.allocate(s.req.id, s.cached + 1)
                    break
                except MemoryError:
                    self.preempt(max(self.running, key=policy.key))

    def _segment(self, s: Sequence, start: float, end: float, state: str) -> Segment:
        return Segment(s.req.id, s.req.priority, s.slot, start, end, state)

    # --- forward passes --------------------------------------------------------------------------
    # Every index a pass needs is built once per pass, in a few vectorised ops (the layers share
    # them): a step's host work stays small next to its forward, on any device.

    def prefill(self, seqs: list[Sequence]) -> None:
        device = self.pool.k.device
        texts = [s.text() for s in seqs]
        lengths = [len(t) for t in texts]
        width = max(lengths)
        tokens = torch.tensor([t + [0] * (width - len(t)) for t in texts], device=device)
        # Padding positions write to (and read) the slot of the row's next position: the first
        # decode step overwrites it, and no real query sees it before then.
        slots = self.pool.padded_slots([s.req.id for s in seqs], lengths, width)  # (B, width)
        # One row needs neither per-row positions nor a mask: its keys are exactly its positions.
        alone = len(seqs) == 1
        start_pos = 0 if alone else torch.zeros(len(seqs), dtype=torch.long, device=device)
        last = True if alone else torch.tensor(lengths, device=device) - 1
        start = self.now()
        logits = self.model(tokens, start_pos=start_pos, cache=RowCache(self.pool, slots, slots),
                            last_only=last)
        fresh = [i for i, s in enumerate(seqs) if not s.out]
        self.emit([seqs[i] for i in fresh], logits[fresh, -1])
        for s, n in zip(seqs, lengths):
            s.cached = n
        recomputed = sum(n for s, n in zip(seqs, lengths) if s.preemptions)
        self.steps.append(Step("prefill", start, self.now(), len(seqs), len(seqs), len(seqs) * width,
                               len(seqs) * width - sum(lengths), recomputed))

    def decode(self) -> None:
        device = self.pool.k.device
        rows = sorted(self.running, key=lambda s: s.slot)
        live = [i for i, s in enumerate(rows) if not s.done]  # a batch's done rows compute: padding
        cached = [s.cached for s in rows]
        read = self.pool.padded_slots([s.req.id for s in rows], cached, max(cached) + 1)  # (B, S)
        if len(rows) == 1:  # as in prefill: a plain start position, no mask
            pos, write = cached[0], read[:, -1:]
        else:
            pos = torch.tensor(cached, device=device)
            write = read.gather(1, pos[:, None])  # (B, 1): the slot of each row's new position
        tokens = torch.tensor([[s.out[-1]] for s in rows], device=device)
        start = self.now()
        logits = self.model(tokens, start_pos=pos, cache=RowCache(self.pool, write, read),
                            last_only=True)[:, -1]
        self.emit([rows[i] for i in live], logits if len(live) == len(rows) else logits[live])
        for s in rows:
            s.cached += 1
        self.steps.append(Step("decode", start, self.now(), len(rows), len(live), len(rows),
                               len(rows) - len(live), 0))

    def emit(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Each sequence's next token from its logits (V,): greedy, or its forced continuation
        (whose log-probability and the greedy choice are recorded)."""
        if not seqs:
            return
        greedy = logits.argmax(dim=-1).tolist()  # one device sync per step, as a server streams
        forced = seqs[0].forced is not None
        if forced:
            logprobs = logits.float().log_softmax(dim=-1)
            chosen = [s.forced[len(s.out)] for s in seqs]
            picked = logprobs[torch.arange(len(seqs)), chosen].tolist()
        now = self.now()
        for i, s in enumerate(seqs):
            if forced:
                s.logprobs.append(picked[i])
                s.top1.append(greedy[i])
            s.out.append(chosen[i] if forced else greedy[i])
            if s.first_token_s is None:
                s.first_token_s, s.first_step = now, len(self.steps)
            if s.done:
                s.finish_s = now


# --- schedulers -------------------------------------------------------------------------------------

class Policy:
    """Chooses what starts (`admit`), what stops (`release`) and who gives way (`key`: the
    largest key is preempted first). `pad_prefill`: new prompts are prefilled as one padded
    batch; otherwise each alone, without padding (as vLLM packs them)."""

    pad_prefill = False

    def key(self, s: Sequence) -> tuple:
        return (s.req.arrival_s, s.req.id)

    def admit(self, eng: Engine, *, more_coming: bool) -> list[Sequence]:
        raise NotImplementedError

    def release(self, eng: Engine) -> None:
        raise NotImplementedError

    def wake_s(self, eng: Engine) -> float | None:
        """When waiting could end without a new arrival (a timeout); None: only an arrival."""
        return None


class BatchPolicy(Policy):
    """Batch at a time: `slots` requests start together and leave together, when the longest is
    done. Static: in arrival order, once `slots` have arrived (or none are left to come).
    Dynamic (`bucket_width`): requests grouped by prompt length; a group starts when full, when its
    oldest request has waited `timeout_s`, or when none are left to come."""

    pad_prefill = True

    def __init__(self, slots: int, bucket_width: int | None = None, timeout_s: float = 0.0):
        self.slots, self.bucket_width, self.timeout_s = slots, bucket_width, timeout_s

    def groups(self, eng: Engine) -> list[list[Sequence]]:
        if self.bucket_width is None:
            return [eng.waiting]
        buckets: dict[int, list[Sequence]] = {}
        for s in eng.waiting:
            buckets.setdefault((s.req.prompt_len - 1) // self.bucket_width, []).append(s)
        return sorted(buckets.values(), key=lambda g: eng.arrival(g[0]))

    def admit(self, eng: Engine, *, more_coming: bool) -> list[Sequence]:
        if eng.running or not eng.waiting:
            return []
        now = eng.now()
        for group in self.groups(eng):
            timed_out = self.bucket_width is not None and now - eng.arrival(group[0]) >= self.timeout_s
            if len(group) >= self.slots or timed_out or not more_coming:
                batch = group[:self.slots]
                for s in batch:
                    eng.start(s)
                return batch
        return []

    def release(self, eng: Engine) -> None:
        if eng.running and all(s.done for s in eng.running):
            for s in list(eng.running):
                eng.stop(s, "served")

    def wake_s(self, eng: Engine) -> float | None:
        if self.bucket_width is None or eng.running or not eng.waiting:
            return None
        return min(eng.arrival(g[0]) for g in self.groups(eng)) + self.timeout_s


class IterationPolicy(Policy):
    """Iteration-level scheduling: a finished sequence leaves at once and the next waiting one
    takes its slot at the next step. First come, first served (continuous), or by class
    (`ranks`: class -> rank, 0 the most urgent), a waiting request preempting running ones of a
    lower class when it finds no slot or no blocks (priority)."""

    def __init__(self, ranks: dict[str, int] | None = None):
        self.ranks = ranks

    def key(self, s: Sequence) -> tuple:
        rank = self.ranks[s.req.priority] if self.ranks else 0
        return (rank, s.req.arrival_s, s.req.id)

    def admit(self, eng: Engine, *, more_coming: bool) -> list[Sequence]:
        new = []
        for s in sorted(eng.waiting, key=self.key):
            if not eng.fits(s) and not self.make_room(eng, s):
                break  # in order: nobody overtakes the head of the queue
            eng.start(s)
            new.append(s)
        return new

    def make_room(self, eng: Engine, s: Sequence) -> bool:
        if not self.ranks:
            return False
        while not eng.fits(s):
            victims = [r for r in eng.running if self.key(r)[0] > self.key(s)[0]]
            if not victims:
                return False
            eng.preempt(max(victims, key=self.key))
        return True

    def release(self, eng: Engine) -> None:
        for s in [s for s in eng.running if s.done]:
            eng.stop(s, "served")
