"""KV cache layouts: the storage behind `forward(..., cache=...)` (see `labkit.blocks.model`).

Every cache takes a layer's new keys and values, (B, kv_heads, T, hd) in the compute dtype, and
returns all the layer's keys and values so far in the compute dtype. What differs is the storage:

- `DynamicCache`: grown by concatenation (every step copies the cache).
- `StaticCache`: one buffer per layer at the longest length, written in place (gpt-fast).
- `PagedCache`: fixed-size blocks from a shared `BlockPool`, found through a block table per
  sequence (vLLM's PagedAttention).
- `QuantizedCache`: int8 (or fp8) values with a scale per token (or per token and head),
  dequantized for attention.

Each offers `tensors()` (its storage, measured by the harness), `num_tokens` (positions held,
summed over the batch) and `capacity` (positions its storage can hold), so bytes per token are
storage bytes / capacity and waste is 1 - num_tokens / capacity.
"""
from __future__ import annotations

import torch

QUANT_MAX = {"int8": 127.0, "fp8": 448.0}  # largest magnitude: int8, float8_e4m3fn
QUANT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


class DynamicCache:
    """Per layer, keys and values of shape (B, kv_heads, S, hd), grown along S by concatenation,
    stored in `dtype` (default: as given)."""

    def __init__(self, num_layers: int, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        compute = k.dtype
        k, v = k.to(self.dtype or compute), v.to(self.dtype or compute)
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k.to(compute), v.to(compute)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in self.keys + self.values if t is not None]

    @property
    def num_tokens(self) -> int:
        """Cached positions times batch: the tokens the cache holds."""
        k = self.keys[0]
        return 0 if k is None else k.shape[0] * k.shape[2]

    capacity = num_tokens  # concatenation allocates exactly what it holds


class StaticCache:
    """Per layer, (B, kv_heads, max_len, hd) allocated up front and written in place; attention
    reads a view of the filled part (no copy when `dtype` is the compute dtype)."""

    def __init__(self, *, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (batch, kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        self.keys[layer][:, :, start:end] = k  # casts to the cache dtype
        self.values[layer][:, :, start:end] = v
        self.lengths[layer] = end
        return self.keys[layer][:, :, :end].to(k.dtype), self.values[layer][:, :, :end].to(v.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return self.keys + self.values

    @property
    def num_tokens(self) -> int:
        return self.keys[0].shape[0] * self.lengths[0]

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0] * self.keys[0].shape[2]


class BlockPool:
    """A fixed pool of KV blocks shared by sequences, with a block table per sequence.

    Storage per K and V: (num_layers, num_blocks * block_size, kv_heads, hd), a block being
    `block_size` consecutive slots. A sequence owns the blocks in its table, in order; position p
    lives in slot `table[p // block_size] * block_size + p % block_size` (vLLM's slot mapping).
    Blocks come from a free list as a sequence grows (`allocate`) and go back on `free`, so a
    sequence wastes at most one partly filled block. Reads are a pure-PyTorch gather of the
    sequence's slots (a copy); vLLM's PagedAttention kernel reads the blocks in place instead.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_blocks * block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # per-layer views made once (no select per call); not unbind's: autograd refuses in-place
        # writes to views of a multi-output op
        self.layers = [(self.k[i], self.v[i]) for i in range(num_layers)]
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self.tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens each sequence holds

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def block_table(self, seq: int) -> list[int]:
        return list(self.tables.get(seq, []))

    def allocate(self, seq: int, num_tokens: int) -> None:
        """Grow `seq`'s table to hold `num_tokens` positions; a MemoryError when the pool is out."""
        table = self.tables.setdefault(seq, [])
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > len(self.free_blocks):
            raise MemoryError(f"KV block pool exhausted: {needed} blocks needed, "
                              f"{len(self.free_blocks)} free")
        table.extend(self.free_blocks.pop() for _ in range(max(needed, 0)))
        self.lengths[seq] = max(self.lengths.get(seq, 0), num_tokens)

    def free(self, seq: int) -> None:
        """Return `seq`'s blocks to the pool."""
        self.free_blocks.extend(reversed(self.tables.pop(seq, [])))
        self.lengths.pop(seq, None)

    def slots(self, seq: int, start: int, end: int) -> torch.Tensor:
        """Slot indices of positions [start, end) of `seq` (allocated), (end - start,)."""
        pos = torch.arange(start, end, device=self.k.device)
        table = torch.tensor(self.tables[seq], device=self.k.device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def padded_slots(self, seqs: list[int], last: list[int], width: int) -> torch.Tensor:
        """(B, width): row b holds the slots of positions 0..last[b] of `seqs[b]`, then last[b]'s
        slot repeated (padding a mask hides), all rows in a few vectorised ops."""
        tables = [self.tables[s] for s in seqs]
        num = max(len(t) for t in tables)
        table = torch.tensor([t + t[-1:] * (num - len(t)) for t in tables], device=self.k.device)
        last_pos = torch.tensor(last, device=self.k.device)[:, None]
        pos = torch.arange(width, device=self.k.device)[None].minimum(last_pos)  # (B, width)
        return table.gather(1, pos // self.block_size) * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (..., kv_heads, hd) at `slots` (...)."""
        n = slots.numel()
        self.put(layer, slots.reshape(n), k.reshape(n, *k.shape[-2:]), v.reshape(n, *v.shape[-2:]))

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at `slots` (...) -> (..., kv_heads, hd) each (a copy)."""
        k, v = self.take(layer, slots.reshape(-1))
        shape = (*slots.shape, *k.shape[-2:])
        return k.view(shape), v.view(shape)

    def put(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """`write` for flat slots (N,) and k, v (N, kv_heads, hd): one in-place copy each."""
        keys, values = self.layers[layer]
        keys.index_copy_(0, slots, k if k.dtype == keys.dtype else k.to(keys.dtype))
        values.index_copy_(0, slots, v if v.dtype == values.dtype else v.to(values.dtype))

    def take(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`gather` for flat slots (N,) -> (N, kv_heads, hd) each: index_select, about 4x
        faster on the CPU than advanced indexing."""
        keys, values = self.layers[layer]
        return keys.index_select(0, slots), values.index_select(0, slots)

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class PagedCache:
    """A batch of equal-length sequences (ids 0..B-1) whose keys and values live in a BlockPool."""

    def __init__(self, pool: BlockPool, batch: int):
        self.pool, self.batch = pool, batch
        self.lengths = [0] * pool.k.shape[0]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        for seq in range(self.batch):
            self.pool.allocate(seq, end)  # a no-op once an earlier layer allocated
        new = torch.stack([self.pool.slots(seq, start, end) for seq in range(self.batch)])  # (B, T)
        self.pool.write(layer, new, k.transpose(1, 2), v.transpose(1, 2))  # (B, T, KV, hd)
        held = torch.stack([self.pool.slots(seq, 0, end) for seq in range(self.batch)])  # (B, S)
        k_all, v_all = self.pool.gather(layer, held)  # (B, S, KV, hd)
        self.lengths[layer] = end
        return k_all.transpose(1, 2).to(k.dtype), v_all.transpose(1, 2).to(v.dtype)

    def tensors(self) -> list[torch.Tensor]:
        return self.pool.tensors()

    @property
    def num_tokens(self) -> int:
        return sum(self.pool.lengths.values())

    @property
    def capacity(self) -> int:
        return self.pool.num_blocks * self.pool.block_size


class QuantizedCache:
    """A static layout holding int8 (or fp8) keys and values plus a scale per token: one per
    (sequence, position) shared by the kv heads (`per_token`), or one per (sequence, kv head,
    position) (`per_head`). Scales are absmax / QUANT_MAX, stored in `scale_dtype`; the filled
    part is dequantized to the compute dtype for attention on every call."""

    def __init__(self, *, num_layers: int, batch: int, kv_heads: int, head_dim: int, max_len: int,
                 scales: str, scale_dtype: torch.dtype, device: torch.device | str,
                 quant: str = "int8"):
        self.per_head, self.quant = scales == "per_head", quant
        data = (batch, kv_heads, max_len, head_dim)
        scale = (batch, kv_heads if self.per_head else 1, max_len, 1)
        qdtype = QUANT_DTYPES[quant]
        self.data = [[torch.zeros(data, dtype=qdtype, device=device) for _ in range(2)]
                     for _ in range(num_layers)]  # [layer][K or V]
        self.scales = [[torch.zeros(scale, dtype=scale_dtype, device=device) for _ in range(2)]
                       for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, KV, T, hd) -> quantized values, scales (B, KV or 1, T, 1)."""
        dims = (-1,) if self.per_head else (1, -1)
        amax = x.float().abs().amax(dim=dims, keepdim=True).clamp(min=1e-12)
        scale = amax / QUANT_MAX[self.quant]
        q = x.float() / scale
        q = q.round().clamp(-127, 127) if self.quant == "int8" else q
        return q.to(QUANT_DTYPES[self.quant]), scale

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self.lengths[layer], self.lengths[layer] + k.shape[2]
        out = []
        for i, x in enumerate((k, v)):
            q, scale = self.quantize(x)
            self.data[layer][i][:, :, start:end] = q
            self.scales[layer][i][:, :, start:end] = scale  # rounded to the scale dtype
            held, s = self.data[layer][i][:, :, :end], self.scales[layer][i][:, :, :end]
            out.append(held.to(x.dtype) * s.to(x.dtype))  # dequantized, (B, KV, S, hd)
        self.lengths[layer] = end
        return out[0], out[1]

    def tensors(self) -> list[torch.Tensor]:
        return [t for layer in self.data + self.scales for t in layer]

    @property
    def num_tokens(self) -> int:
        return self.data[0][0].shape[0] * self.lengths[0]

    @property
    def capacity(self) -> int:
        return self.data[0][0].shape[0] * self.data[0][0].shape[2]


def block_table_frame(pool: BlockPool):
    """The pool's block tables as a pandas DataFrame (one row per logical block): sequence,
    logical_block, physical_block, tokens_used (the last block of a sequence may be partly
    filled). A notebook can plot it as physical block against sequence."""
    import pandas as pd

    rows = []
    for seq, table in sorted(pool.tables.items()):
        length = pool.lengths[seq]
        for logical, physical in enumerate(table):
            used = min(pool.block_size, length - logical * pool.block_size)
            rows.append({"sequence": seq, "logical_block": logical, "physical_block": physical,
                         "tokens_used": used})
    return pd.DataFrame(rows, columns=["sequence", "logical_block", "physical_block", "tokens_used"])
