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
- vLLM's two tricks, for the paging schedulers (the engine's `prefix_cache` and `prefill_chunk`):
  automatic prefix caching (`PrefixCachingPool`: full blocks kept by a hash chained over their
  tokens and their prefix; a new or resumed request reuses the cached blocks its text starts with,
  shared and reference-counted, and prefills only the rest), and chunked prefill (a prompt
  prefilled `prefill_chunk` positions per iteration, the running sequences decoding in between,
  as Sarathi and vLLM do, so a long prompt no longer stalls everyone's next token).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
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

    @property
    def prefilled(self) -> bool:
        """Its whole text is in the cache (a chunked prefill may still be under way)."""
        return self.cached >= len(self.prompt) + max(len(self.out) - 1, 0)


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
    reused: int = 0  # prefill: positions taken from the prefix cache instead of computed


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


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """One hash per full block of `tokens`, each chained over the block's tokens and the hash of
    everything before it (vLLM's prefix-caching key): equal hashes mean equal prefixes, so a
    block is reused only where the whole text before it matches too. Python's hash of a tuple of
    ints (64 bits, not salted per process); a collision would reuse a wrong block, and vLLM
    offers sha256 for that reason."""
    hashes, parent = [], None
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = chain_hash(parent, tokens[start:start + block_size])
        hashes.append(parent)
    return hashes


def chain_hash(parent: int | None, block: list[int]) -> int:
    """One full block's key: its tokens and the key of everything before it."""
    return hash((parent, tuple(block)))


def reusable_blocks(tokens: list[int], block_size: int) -> int:
    """Full blocks a lookup may reuse: at least one position is always computed, since the
    last position's logits give the next token."""
    return (len(tokens) - 1) // block_size


class PrefixCachingPool(BlockPool):
    """A BlockPool that keeps computed full blocks by hash (`block_hashes`) for later requests.

    A block is reference-counted: `share_prefix` hands a sequence the cached blocks its text starts
    with (shared, never written again: they are full and the sequence writes only past them);
    `commit` registers the blocks a sequence has just computed. A freed block whose count drops to
    0 keeps its hash and stays cached (`evictable`) until the pool needs it: blocks with no hash
    go first, then the least recently freed cached one (a sequence's tail blocks before its
    prefix, as vLLM frees them in reverse)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.refs = [0] * self.num_blocks
        self.cached: dict[int, int] = {}  # hash -> block
        self.hash_of: dict[int, int] = {}  # block -> hash
        self.evictable: OrderedDict[int, None] = OrderedDict()  # count 0, hashed: oldest first
        self.chains: dict[int, list[int]] = {}  # seq -> hashes of its leading committed blocks
        self.num_evicted = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.evictable)

    def lookup(self, tokens: list[int]) -> list[int]:
        """The cached blocks `tokens` starts with (at most `reusable_blocks`), in order."""
        hits = []
        for h in block_hashes(tokens[:reusable_blocks(tokens, self.block_size) * self.block_size],
                              self.block_size):
            if h not in self.cached:
                break
            hits.append(self.cached[h])
        return hits

    def new_blocks_for(self, tokens: list[int], num_tokens: int) -> tuple[int, int]:
        """(blocks to take from the free ones, free blocks there are) for a sequence starting on
        `tokens` and holding `num_tokens`: a cached hit costs no new block, and one waiting to be
        evicted is no longer free once shared."""
        hits = self.lookup(tokens)
        need = -(-num_tokens // self.block_size) - len(hits)
        return need, self.num_free_blocks - sum(b in self.evictable for b in hits)

    def share_prefix(self, seq: int, tokens: list[int]) -> int:
        """Point `seq`'s leading table entries at the cached blocks `tokens` starts with (a block
        allocated there before is released: nothing was written in it yet); returns the hit count."""
        hits, table = self.lookup(tokens), self.tables.setdefault(seq, [])
        for i, block in enumerate(hits):
            if i < len(table) and table[i] == block:
                continue
            self.evictable.pop(block, None)
            self.refs[block] += 1
            if i < len(table):
                self.release(table[i])
                table[i] = block
            else:
                table.append(block)
        self.chains[seq] = block_hashes(tokens[:len(hits) * self.block_size], self.block_size)
        return len(hits)

    def commit(self, seq: int, tokens: list[int], num_computed: int) -> None:
        """Register `seq`'s full blocks among its first `num_computed` positions (`tokens`: its
        text so far). A block whose hash another block already holds (computed twice, at once)
        stays private."""
        chain, table = self.chains.setdefault(seq, []), self.tables[seq]
        for i in range(len(chain), num_computed // self.block_size):
            h = chain_hash(chain[-1] if chain else None,
                           tokens[i * self.block_size:(i + 1) * self.block_size])
            chain.append(h)
            if h not in self.cached and table[i] not in self.hash_of:
                self.cached[h], self.hash_of[table[i]] = table[i], h

    def take_block(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.pop()
        else:  # evict the least recently freed cached block
            block, _ = self.evictable.popitem(last=False)
            del self.cached[self.hash_of.pop(block)]
            self.num_evicted += 1
        self.refs[block] = 1
        return block

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            if block in self.hash_of:
                self.evictable[block] = None
            else:
                self.free_blocks.append(block)

    def allocate(self, seq: int, num_tokens: int) -> None:
        table = self.tables.setdefault(seq, [])
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > self.num_free_blocks:
            raise MemoryError(f"KV block pool exhausted: {needed} blocks needed, "
                              f"{self.num_free_blocks} free")
        table.extend(self.take_block() for _ in range(max(needed, 0)))
        self.lengths[seq] = max(self.lengths.get(seq, 0), num_tokens)

    def free(self, seq: int) -> None:
        for block in reversed(self.tables.pop(seq, [])):  # tail first: evicted before the prefix
            self.release(block)
        self.lengths.pop(seq, None)
        self.chains.pop(seq, None)


class Engine:
    """Serves `seqs` (in arrival order) on `model` with `num_slots` rows at most and a pool of
    `num_blocks` blocks of `block_size` positions. `reserve`: tokens a sequence takes when it
    starts (the longest possible sequence for reservation; 0: paging, as it grows).
    `prefix_cache`: a `PrefixCachingPool` (empty at the start of every replay); `prefill_chunk`:
    positions a sequence prefills per iteration at most (0: its whole text at once). Both are for
    policies that prefill each request alone (not `pad_prefill`)."""

    def __init__(self, model: Decoder, seqs: list[Sequence], *, num_slots: int, num_blocks: int,
                 block_size: int, reserve: int, kv_dtype: torch.dtype, closed: bool = False,
                 prefix_cache: bool = False, prefill_chunk: int = 0):
        m, device = model.cfg, model.embed.weight.device
        self.model, self.seqs, self.reserve, self.closed = model, seqs, reserve, closed
        self.prefix_cache, self.prefill_chunk = prefix_cache, prefill_chunk
        pool = PrefixCachingPool if prefix_cache else BlockPool
        self.pool = pool(num_layers=m.num_layers, num_blocks=num_blocks, block_size=block_size,
                         kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=kv_dtype, device=device)
        self.num_lookup_blocks = 0  # full blocks prefix lookups could have reused
        self.num_hit_blocks = 0  # of which were reused
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
            if new and policy.pad_prefill:
                self.prefill(new)
            # each alone, in the order they started: a new one, or the next chunk of a long one
            filling = [s for s in self.running if not s.prefilled]
            for s in filling:
                self.prefill_part(s)
            if new or filling:
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
        """A free slot, and blocks for its prefill and first decoded position (less the cached
        blocks its text starts with)."""
        tokens = max(self.reserve, len(s.text()) + 1)
        if self.prefix_cache:
            need, free = self.pool.new_blocks_for(s.text(), tokens)
        else:
            need, free = self.blocks_for(tokens), self.pool.num_free_blocks
        return bool(self.free_slots) and need <= free

    def start(self, s: Sequence) -> None:
        if self.prefix_cache:  # the hits first, so that allocating cannot evict them
            self.pool.share_prefix(s.req.id, s.text())
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

    def prefill_part(self, s: Sequence) -> None:
        """One pass over `s` alone: the next `prefill_chunk` positions of its text (all of them
        when 0), after the cached prefix on its first pass; the last part yields its next token."""
        text = s.text()
        reused = 0
        if self.prefix_cache and s.cached == 0:  # blocks committed since it started count too
            reused = self.pool.share_prefix(s.req.id, text) * self.pool.block_size
            self.num_lookup_blocks += reusable_blocks(text, self.pool.block_size)
            self.num_hit_blocks += reused // self.pool.block_size
            s.cached = reused
        begin = s.cached
        end = min(len(text), begin + self.prefill_chunk) if self.prefill_chunk else len(text)
        device = self.pool.k.device
        read = self.pool.slots(s.req.id, 0, end)[None]  # (1, end): keys of positions 0..end-1
        tokens = torch.tensor([text[begin:end]], device=device)
        start = self.now()
        logits = self.model(tokens, start_pos=begin, cache=RowCache(self.pool, read[:, begin:], read),
                            last_only=True)
        s.cached = end
        if end == len(text) and not s.out:
            self.emit([s], logits[:, -1])
        if self.prefix_cache:
            self.pool.commit(s.req.id, text, end)
        recomputed = end - begin if s.preemptions else 0
        self.steps.append(Step("prefill", start, self.now(), 1, 1, end - begin, 0, recomputed,
                               reused=reused))

    def decode(self) -> None:
        device = self.pool.k.device
        rows = sorted((s for s in self.running if s.prefilled), key=lambda s: s.slot)
        if not rows:  # every running sequence is still prefilling
            return
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
            if self.prefix_cache and s.cached % self.pool.block_size == 0:  # a block just filled
                self.pool.commit(s.req.id, s.prompt + s.out, s.cached)
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
