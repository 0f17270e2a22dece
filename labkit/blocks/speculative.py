"""Speculative decoding's building blocks: a cache that can be rewound, two proposers, the verify
loop, and Leviathan et al.'s napkin math (https://arxiv.org/abs/2211.17192).

A proposer guesses the next tokens cheaply; the target checks all of them in ONE forward of k + 1
tokens (the pending token and the k guesses) and keeps the longest prefix it agrees with, plus its
own next token. So a step emits 1 to k + 1 tokens for one target forward, and, with greedy
verification, exactly the tokens greedy decoding gives: a guess only changes the cost.

- `DraftProposer`: a smaller model proposes k tokens greedily, with its own cache (gpt-fast).
- `PromptLookup`: the tokens that followed the latest earlier occurrence of the text's last
  n-gram (prompt lookup decoding, transformers' `prompt_lookup_num_tokens`): no model at all.

A proposer is any callable `(seq: list[int], k: int) -> list[int]` (at most k guesses for the
tokens after `seq`) with `reset()` called before each generation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from labkit.blocks.kv_caches import StaticCache
from labkit.blocks.model import Decoder


class Proposer(Protocol):
    def __call__(self, seq: list[int], k: int) -> list[int]: ...
    def reset(self) -> None: ...


class RewindableCache(StaticCache):
    """A static cache whose length can be moved back: the positions past it are overwritten by
    the next update, so rejected guesses cost nothing to undo (no copy, no free)."""

    @property
    def length(self) -> int:
        return self.lengths[0]

    def rewind(self, length: int) -> None:
        """Keep positions [0, length) of every layer; `length` at most the current length."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind a cache of {self.length} positions to {length}")
        self.lengths = [length] * len(self.lengths)


def make_cache(model: Decoder, max_len: int, batch: int = 1) -> RewindableCache:
    m, p = model.cfg, next(model.parameters())
    return RewindableCache(num_layers=m.num_layers, batch=batch, kv_heads=m.num_kv_heads,
                           head_dim=m.head_dim, max_len=max_len, dtype=p.dtype, device=p.device)


# --- proposers ------------------------------------------------------------------------------------

class NoProposer:
    """Proposes nothing: the verify loop becomes plain greedy decoding, one token per forward."""

    def __call__(self, seq: list[int], k: int) -> list[int]:
        return []

    def reset(self) -> None: ...


def lookup(seq: list[int], ngram: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of seq's last `ngram` tokens
    (the occurrence that is the tail itself excluded); [] when there is none."""
    if k <= 0 or len(seq) <= ngram:
        return []
    tail, last = seq[-ngram:], seq[-1]
    for end in range(len(seq) - 2, ngram - 2, -1):  # end: the candidate's last index, latest first
        if seq[end] == last and seq[end - ngram + 1:end + 1] == tail:
            return seq[end + 1:end + 1 + k]
    return []


@dataclass
class PromptLookup:
    """n-gram proposals: the longest of `ngram`, `ngram` - 1, ..., `min_ngram` tokens that occurs
    earlier wins (a longer match is likelier to continue the same way), as transformers does."""

    ngram: int = 3
    min_ngram: int = 1

    def __call__(self, seq: list[int], k: int) -> list[int]:
        for n in range(self.ngram, self.min_ngram - 1, -1):
            found = lookup(seq, n, k)
            if found:
                return found
        return []

    def reset(self) -> None: ...


class DraftProposer:
    """A draft model proposes k tokens greedily. Its cache keeps what it has already read: before
    proposing it is rewound to the positions still valid (all of `seq` but its last token, or
    fewer where its own guesses were rejected) and fed the rest in one forward."""

    def __init__(self, model: Decoder, max_len: int):
        self.model, self.max_len = model, max_len
        self.reset()

    def reset(self) -> None:
        self.cache = make_cache(self.model, self.max_len)

    def __call__(self, seq: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        held = min(self.cache.length, len(seq) - 1)
        self.cache.rewind(held)
        device = self.cache.keys[0].device
        feed = torch.tensor([seq[held:]], device=device)  # (1, new positions)
        token = self.model(feed, start_pos=held, cache=self.cache, last_only=True).argmax(-1)
        out = [token]  # (1, 1) each
        for i in range(k - 1):
            token = self.model(token, start_pos=len(seq) + i, cache=self.cache,
                               last_only=True).argmax(-1)
            out.append(token)
        return torch.cat(out, dim=1)[0].tolist()


# --- the verify loop ------------------------------------------------------------------------------

@dataclass
class SpecStats:
    """What one generation did. A step is one target forward (the prefill is the first, with no
    proposal); `proposal_lens[s]` and `accepted[s]` are step s's guesses and accepted guesses."""

    proposal_lens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def num_steps(self) -> int:
        return len(self.proposal_lens)

    @property
    def num_proposed(self) -> int:
        return sum(self.proposal_lens)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted)

    @property
    def num_examined(self) -> int:
        """Guesses the target judged until its first rejection (each step stops at its first)."""
        return sum(a + (a < k) for k, a in zip(self.proposal_lens, self.accepted))


def accepted_prefix(guess: list[int], target: list[int]) -> int:
    """How many leading guesses equal the target's greedy tokens (target[i] follows guess[:i])."""
    n = 0
    while n < len(guess) and guess[n] == target[n]:
        n += 1
    return n


@torch.inference_mode()
def generate_speculative(model: Decoder, prompt: torch.Tensor, new_tokens: int,
                         propose: Proposer, num_speculative: int,
                         cache: RewindableCache | None = None) -> tuple[torch.Tensor, SpecStats]:
    """(1, P) prompt -> ((1, new_tokens) greedy tokens of `model`, stats). Each step feeds the
    pending token and up to `num_speculative` guesses (never more than the tokens still wanted
    minus one), takes the target's argmax at every position, keeps the agreeing guesses plus the
    target's own next token, and rewinds the cache past the rest."""
    if prompt.shape[0] != 1:
        raise ValueError("speculative decoding here runs one sequence (batch 1)")
    num_prompt = prompt.shape[1]
    cache = cache or make_cache(model, num_prompt + new_tokens + num_speculative)
    propose.reset()
    seq = prompt[0].tolist()
    seq.append(int(model(prompt, cache=cache, last_only=True)[0, -1].argmax()))
    stats = SpecStats([0], [0])
    while len(seq) - num_prompt < new_tokens:
        wanted = new_tokens - (len(seq) - num_prompt)
        guess = propose(seq, min(num_speculative, wanted - 1))
        start = len(seq) - 1  # the pending token's position: the cache holds everything before
        feed = torch.tensor([seq[-1:] + guess], device=prompt.device)  # (1, 1 + len(guess))
        target = model(feed, start_pos=start, cache=cache)[0].argmax(-1).tolist()
        n = accepted_prefix(guess, target)
        seq += guess[:n] + [target[n]]
        cache.rewind(start + 1 + n)  # the pending token and the accepted guesses stay
        stats.proposal_lens.append(len(guess))
        stats.accepted.append(n)
    return torch.tensor([seq[num_prompt:]], device=prompt.device), stats


# --- napkin math (Leviathan et al. 2023, section 3) -----------------------------------------------

def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E[tokens per target forward] = (1 - alpha^(k+1)) / (1 - alpha) for i.i.d. acceptance
    with probability alpha of each of k guesses; k + 1 at alpha = 1."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Walltime improvement over greedy decoding: E[tokens per step] / (k c + 1), c the cost of
    one proposal token in target forwards (the k + 1-token verify costs one forward)."""
    return expected_tokens_per_step(alpha, k) / (k * cost_ratio + 1)


def alpha_estimate(stats: SpecStats) -> float:
    """Leviathan's alpha from a run: accepted / examined guesses (a guess past the first
    rejection of its step is never judged, so accepted / proposed would undercount it)."""
    return stats.num_accepted / stats.num_examined if stats.num_examined else 0.0


def predicted_tokens_per_step(stats: SpecStats, alpha: float) -> float:
    """The formula averaged over the run's steps at their own proposal lengths (a step with no
    guess, the prefill or a failed lookup, emits one token)."""
    return sum(expected_tokens_per_step(alpha, k) for k in stats.proposal_lens) / stats.num_steps

