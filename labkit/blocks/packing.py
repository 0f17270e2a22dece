"""Documents of varied lengths as training batches: padded rows, or packed rows with a document id
per token (what HF's DataCollatorWithFlattening, TRL's `padding_free` and axolotl's multipack
hand the model).

- A document is a 1-D tensor of token ids (1..vocab-1; 0 is the pad). As a training sample it
  predicts each next token inside itself: targets are its tokens shifted by one, and its last
  token has no target (-100, the loss's `ignore_index`).
- `padded`: one document per row, right-padded to the longest in the batch. Under a causal mask
  a real token never sees the pads after it, so each row computes its document alone.
- `packed`: documents placed whole into rows of `seq_len` tokens (first-fit decreasing, as
  multipack's bin packing; a document longer than a row is first split into row-sized pieces,
  each a document of its own), with `document_ids` per token (-1 for a row's trailing pads) and
  `positions` restarting at 0 per document. No target crosses a boundary.
Attention must then stay inside each document: the decoder's `document_ids=` builds the
block-diagonal causal mask and the restarting positions (`labkit.blocks.model.document_mask`).
Without them (`packed_naive`) each document attends to the ones before it in its row.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

PAD_ID = 0
IGNORE = -100  # cross_entropy's ignore_index: labkit's loss skips these targets
LAYOUTS = ("padded", "packed")


@dataclass(frozen=True)
class Batch:
    """One step's rows: tokens, targets (IGNORE where none), document ids (-1: pad) and
    positions within each document, all (rows, T) int64; `lengths[i]` is document i's length."""

    tokens: torch.Tensor
    targets: torch.Tensor
    document_ids: torch.Tensor
    positions: torch.Tensor
    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        """Token slots the step computes, pads included: rows x T."""
        return self.tokens.numel()

    @property
    def num_pad(self) -> int:
        return int((self.document_ids < 0).sum())

    @property
    def padding_fraction(self) -> float:
        """Pad tokens over all tokens computed, counted."""
        return self.num_pad / self.num_tokens

    def to(self, device: str | torch.device) -> Batch:
        move = {k: getattr(self, k).to(device) for k in ("tokens", "targets", "document_ids", "positions")}
        return Batch(**move, lengths=self.lengths)


# --- the documents ---------------------------------------------------------------------------------

def draw_lengths(num_documents: int, *, median_len: int, sigma: float, max_len: int,
                 seed: int) -> list[int]:
    """Log-normal lengths (median `median_len`, log-spread `sigma`), as instruction data has them:
    many short, a few long; rounded and clipped to [2, max_len] (2: one next-token target)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.empty(num_documents, dtype=torch.float64).log_normal_(math.log(median_len), sigma, generator=gen)
    return [_length(x, max_len) for x in raw.tolist()]


def _length(raw: float, max_len: int) -> int:
    """A drawn length rounded and clipped to [2, max_len] (2: one next-token target)."""
    return min(max(round(raw), 2), max_len)


def draw_documents(num_documents: int, *, median_len: int, sigma: float, max_len: int,
                   vocab_size: int, seed: int) -> list[torch.Tensor]:
    """Seeded documents: `draw_lengths` lengths, tokens uniform in 1..vocab_size-1."""
    lengths = draw_lengths(num_documents, median_len=median_len, sigma=sigma, max_len=max_len, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(1, vocab_size, (n,), generator=gen) for n in lengths]


def split_long(documents: Sequence[torch.Tensor], seq_len: int) -> list[torch.Tensor]:
    """Each document longer than a row cut into pieces of at most `seq_len` tokens (each then a
    document of its own); the others as they are."""
    return [piece for d in documents for piece in d.split(seq_len)]


def document_targets(doc: torch.Tensor) -> torch.Tensor:
    """Next-token targets inside one document: its tokens shifted by one, IGNORE for the last."""
    return torch.cat([doc[1:], doc.new_full((1,), IGNORE)])


# --- the two layouts -------------------------------------------------------------------------------

def first_fit(lengths: Sequence[int], capacity: int, *, decreasing: bool = True,
              rows: int = 0) -> list[list[int]]:
    """First-fit (decreasing: longest first; else in the given order): each document into the
    first row with room, a new row when none has it, or into `rows` rows only. Returns each
    row's document indices in the order placed."""
    if any(n > capacity for n in lengths):
        raise ValueError(f"a document of {max(lengths)} tokens does not fit a row of {capacity}; "
                         "split_long first")
    placed: list[list[int]] = [[] for _ in range(rows)]
    room: list[int] = [capacity] * rows
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i]) if decreasing else range(len(lengths))
    for i in order:
        row = next((r for r, left in enumerate(room) if left >= lengths[i]), None)
        if row is None:
            if rows:
                raise ValueError(f"document {i} ({lengths[i]} tokens) fits none of the {rows} rows")
            placed.append([])
            room.append(capacity)
            row = len(placed) - 1
        placed[row].append(i)
        room[row] -= lengths[i]
    return placed


def _rows(documents: Sequence[torch.Tensor], rows: list[list[int]], width: int) -> Batch:
    """Rows of `width` holding `rows[r]`'s documents in turn, then pads."""
    shape = (len(rows), width)
    tokens = torch.full(shape, PAD_ID, dtype=torch.long)
    targets = torch.full(shape, IGNORE, dtype=torch.long)
    ids = torch.full(shape, -1, dtype=torch.long)
    positions = torch.zeros(shape, dtype=torch.long)
    for r, members in enumerate(rows):
        start = 0
        for i in members:
            n = len(documents[i])
            span = slice(start, start + n)
            tokens[r, span], targets[r, span] = documents[i], document_targets(documents[i])
            ids[r, span], positions[r, span] = i, torch.arange(n)
            start += n
    return Batch(tokens, targets, ids, positions, tuple(len(d) for d in documents))


def pad_batch(documents: Sequence[torch.Tensor]) -> Batch:
    """One document per row, right-padded to the longest."""
    return _rows(documents, [[i] for i in range(len(documents))], max(len(d) for d in documents))


def pack_batch(documents: Sequence[torch.Tensor], seq_len: int) -> Batch:
    """Rows of `seq_len` tokens, documents placed whole by `first_fit` (split first where longer
    than a row)."""
    documents = split_long(documents, seq_len)
    return _rows(documents, first_fit([len(d) for d in documents], seq_len), seq_len)


def make_batch(layout: str, documents: Sequence[torch.Tensor], seq_len: int) -> Batch:
    """The documents in `layout` (padded or packed). Both split documents longer than `seq_len`
    alike, so they hold the same documents."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; valid: {', '.join(LAYOUTS)}")
    return pad_batch(split_long(documents, seq_len)) if layout == "padded" else pack_batch(documents, seq_len)


def batches(layout: str, *, num_documents: int, seq_len: int, vocab_size: int, median_len: int,
            sigma: float, seed: int) -> Iterator[Batch]:
    """A batch source: every step `num_documents` fresh seeded documents in `layout`. Each Batch
    carries tokens, targets and per-token document ids, what a training step needs."""
    step = 0
    while True:
        yield make_batch(layout, draw_documents(num_documents, median_len=median_len, sigma=sigma,
                                                max_len=seq_len, vocab_size=vocab_size,
                                                seed=seed + 2 * step), seq_len)
        step += 1


# --- the napkin math -------------------------------------------------------------------------------

def padding_fraction(lengths: Sequence[int], rows: int, row_len: int) -> float:
    """1 - sum(lengths) / (rows x row_len): the share of computed token slots that are pads."""
    return 1 - sum(lengths) / (rows * row_len)


def packed_rows(lengths: Sequence[int], seq_len: int) -> int:
    """Rows an ideal packing needs: ceil(sum / seq_len) (first-fit decreasing may need one more)."""
    return math.ceil(sum(lengths) / seq_len)


def causal_pairs(n: int) -> int:
    """(query, key) pairs a causal mask allows in n tokens: n (n + 1) / 2."""
    return n * (n + 1) // 2


def document_pairs(lengths: Sequence[int]) -> int:
    """Pairs the documents need: each attends causally within itself."""
    return sum(causal_pairs(n) for n in lengths)


def fill_rows(rows: int, seq_len: int, *, vocab_size: int, seed: int, median_len: int | None = None,
              sigma: float = 1.0) -> list[torch.Tensor]:
    """Seeded documents that fill `rows` rows of `seq_len` (`rows_in_order`): drawn one at a time
    (log-normal lengths, median `median_len`, a quarter of a row by default), each placed in
    the first row with room, until the first that fits no row (left out). The recipe's batch."""
    median_len = median_len or max(2, seq_len // 4)
    gen = torch.Generator().manual_seed(seed)
    room, out = [seq_len] * rows, []
    while True:
        n = _length(torch.empty(1, dtype=torch.float64).log_normal_(
            math.log(median_len), sigma, generator=gen).item(), seq_len)
        row = next((r for r, left in enumerate(room) if left >= n), None)
        if row is None:
            return out
        room[row] -= n
        out.append(torch.randint(1, vocab_size, (n,), generator=gen))


def rows_in_order(documents: Sequence[torch.Tensor], rows: int, seq_len: int) -> Batch:
    """`documents` packed into exactly `rows` rows of `seq_len`, first-fit in their order (as
    `fill_rows` placed them): the same rows on every rank, so data parallelism can split them."""
    return _rows(documents, first_fit([len(d) for d in documents], seq_len, decreasing=False, rows=rows),
                 seq_len)


# --- the step: a packed (or padded) batch in a Trainer ----------------------------------------------

def apply_packing(trainer, batch: Batch, *, document_mask: bool = True):
    """The trainer's batch becomes `batch` (on its device): its loss is the mean over the tokens
    with a target (`Trainer.loss_tokens`), and with `document_mask` every forward gets the
    document ids (block-diagonal causal attention, positions per document)."""
    batch = batch.to(trainer.cfg.device)
    trainer.inputs, trainer.targets = batch.tokens, batch.targets
    trainer.sizes = [len(batch.tokens)]
    trainer.document_ids = batch.document_ids if document_mask else None
    trainer.loss_tokens = float((batch.targets != IGNORE).sum())
    return trainer
