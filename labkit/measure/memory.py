"""Memory: bytes measured from tensor storage, never from a config.

- `storage_bytes`: bytes of a set of tensors at rest (each storage once; a DTensor's local shard).
- `MemoryMeter`: peak and current bytes allocated inside a block. CUDA: the caching allocator's
  counters plus NVML. CPU: `LiveTensorTracker`, a dispatch mode that follows every storage an op
  returns until it is freed (`torch.cuda.memory_allocated()` is 0 on a CPU build).
- A virtual budget makes the CPU tracker raise `torch.OutOfMemoryError` past it (and caps the CUDA
  allocator), so OOM handling can be exercised without a GPU.
- `SavedTensorMeter`: the bytes autograd saves for backward, by dtype and by producing op.
- `SavedBytes`: the peak of the bytes autograd holds saved, each storage from its first pack to
  the release of its last saved tensor (a pipeline stage's micro-batches in flight).
"""
from __future__ import annotations

import atexit
import collections
import gc
import sys
import time
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from labkit import hardware


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") and hasattr(t, "placements") else t


def tensors_in(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested tuples, lists, dicts): what pytree's
    `tree_leaves` finds, several times faster, which matters once per dispatched op."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif not isinstance(obj, (tuple, list)):
        return []
    out = []
    for x in obj:  # an op's arguments are mostly flat: recurse only into containers
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list, dict)):
            out.extend(tensors_in(x))
    return out


def storage_keys(tensors: Iterable[torch.Tensor]) -> set[int]:
    """The identities of the storages under `tensors`, each once (a view shares its base's)."""
    return {st._cdata for st in map(_storage, tensors) if st is not None}


PLAIN = (torch.Tensor, torch.nn.Parameter)  # types with a storage of their own, no wrapper to probe
# The ops whose tensors a process group's worker thread may still hold when the call returns:
# the functional collectives (DTensor's) and c10d's own (torch.distributed.all_to_all_single...)
COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d")


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    if type(t) not in PLAIN:  # a DTensor's shard, a wrapper subclass: the rarer, slower path
        t = local_tensor(t)
        if not hasattr(t, "untyped_storage"):
            return None
    if t.is_meta:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
        return None


def _opaque(t: torch.Tensor) -> bool:
    """A wrapper subclass other than a DTensor (whose local shard `_storage` counts); the caller
    has left out the PLAIN types."""
    return is_traceable_wrapper_subclass(t) and not hasattr(t, "placements")


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def inner_tensors(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """The tensors whose storage holds `tensors`: a plain tensor itself, a wrapper subclass
    (torchao's NF4Tensor, DTensor) its inner tensors (`__tensor_flatten__`), recursively; a
    wrapper's own storage is a placeholder of the unwrapped size."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from inner_tensors(getattr(t, name) for name in names)
        else:
            yield t


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views and tied weights counted once; a
    tensor subclass by its inner tensors)."""
    seen: dict[int, int] = {}
    for t in inner_tensors(tensors):
        st = _storage(t) if isinstance(t, torch.Tensor) else None
        if st is not None:
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def budget_message(needed: int, budget: int) -> str:
    return (f"labkit virtual memory budget exceeded: {needed / 2**30:.3f} GiB live "
            f"> {budget / 2**30:.3f} GiB budget")


class LiveTensorTracker(TorchDispatchMode):
    """Live bytes of the storages created inside the mode, and their peak; `collective_buffers`:
    the storages that collectives (COLLECTIVE_NAMESPACES) read or made."""

    def __init__(self, budget_bytes: int | None = None):
        super().__init__()
        self.budget_bytes = budget_bytes
        self.live: dict[int, int] = {}
        self.collective_buffers: set[int] = set()
        self.dtypes: dict[int, str] = {}  # of the first tensor seen on each storage
        self.current_bytes = 0
        self.peak_bytes = 0

    def __enter__(self):
        # FSDP2 frees a gathered parameter with `storage.resize_(0)` and later gathers into the
        # same storage again; resizing a storage is not a dispatched op, so follow it here.
        self._resize = original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = original(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _resized(self, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self.live:
            self.current_bytes += st.nbytes() - self.live[key]
            self.live[key] = st.nbytes()
            self._account()

    def _account(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        if self.budget_bytes is not None and self.current_bytes > self.budget_bytes:
            raise torch.OutOfMemoryError(budget_message(self.current_bytes, self.budget_bytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = tensors_in(args) + tensors_in(kwargs) if kwargs else tensors_in(args)
        if any(type(t) not in PLAIN and _opaque(t) for t in tensors):
            # A wrapper subclass (torchao's 8-bit optimizer states) runs its ops on its inner
            # tensors; declining the op here lets them come back through this mode, so its
            # temporaries and its new inner tensors are counted, not its placeholder's size.
            return NotImplemented
        out = func(*args, **kwargs)
        # An output on an input's storage (a view, an in-place op) allocated nothing; without this,
        # a view of a tensor made before the mode (a parameter's .t()) would count as new.
        inputs = {st._cdata for t in tensors if (st := _storage(t)) is not None}
        for t in tensors_in(out):
            self._track(t, inputs)
        if func.namespace in COLLECTIVE_NAMESPACES:
            self.collective_buffers |= inputs | storage_keys(tensors_in(out))
        return out

    def _track(self, t: torch.Tensor, inputs: set[int] = frozenset()) -> None:
        st = _storage(t)
        if st is None or st._cdata in self.live or st._cdata in inputs:
            return
        key, nbytes = st._cdata, st.nbytes()
        self.live[key] = nbytes
        self.dtypes[key] = _dtype_name(t)
        self.current_bytes += nbytes
        weakref.finalize(st, self._free, key)
        self._account()

    def _free(self, key: int) -> None:
        self.current_bytes -= self.live.pop(key, 0)
        self.dtypes.pop(key, None)

    def live_by_dtype(self, skip: set[int] = frozenset(), only: set[int] | None = None
                      ) -> collections.Counter[str]:
        """Live bytes by dtype, leaving out the storages `skip`; with `only`, of those storages
        alone (`storage_keys`)."""
        out: collections.Counter[str] = collections.Counter()
        for key, nbytes in list(self.live.items()):
            if key not in skip and (only is None or key in only):
                out[self.dtypes.get(key, "unknown")] += nbytes
        return out

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes


class MemoryMeter:
    """Bytes allocated inside the `with` block on `device`: `current_bytes`, `peak_bytes` (since
    entry or the last `reset_peak()`), and on CUDA `reserved_bytes` and `nvml_used_bytes`."""

    def __init__(self, device: str, budget_bytes: int | None = None):
        self.device, self.budget_bytes = device, budget_bytes
        self.cuda = device.startswith("cuda")
        self.tracker = None if self.cuda else LiveTensorTracker(budget_bytes)
        self.baseline = 0

    def __enter__(self) -> "MemoryMeter":
        if self.cuda:
            free_device_memory(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline = torch.cuda.memory_allocated(self.device)
            if self.budget_bytes is not None:
                total = torch.cuda.get_device_properties(self.device).total_memory
                fraction = min(1.0, (self.budget_bytes + self.baseline) / total)
                torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        else:
            self.tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            if self.budget_bytes is not None:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        else:
            self.tracker.__exit__(*exc)

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.tracker.reset_peak()

    @property
    def current_bytes(self) -> int:
        if self.cuda:
            return torch.cuda.memory_allocated(self.device) - self.baseline
        return self.tracker.current_bytes

    @property
    def peak_bytes(self) -> int:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return self.tracker.peak_bytes

    @property
    def reserved_bytes(self) -> int | None:
        return torch.cuda.max_memory_reserved(self.device) if self.cuda else None

    @property
    def nvml_used_bytes(self) -> int | None:
        if not self.cuda:
            return None
        index = torch.device(self.device).index or 0
        sample = hardware.nvml_sample(index)
        return sample["memory_used_bytes"] if sample else None


# What torch's CPU allocator says when the OS refuses memory: a plain RuntimeError, where CUDA
# raises torch.OutOfMemoryError ("[enforce fail at alloc_cpu.cpp:...] ... DefaultCPUAllocator:
# can't allocate memory: you tried to allocate N bytes. Error code 12 (Cannot allocate memory)").
CPU_ALLOCATOR_OOM = "DefaultCPUAllocator: can't allocate memory"


def is_out_of_memory(e: BaseException) -> bool:
    """Whether `e` is an allocation failure: CUDA's (or the virtual budget's) OutOfMemoryError,
    or the CPU allocator's RuntimeError."""
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and CPU_ALLOCATOR_OOM in str(e))


def freeze_survivors() -> None:
    """Collect, then leave every object alive now out of all later collections (`gc.freeze`):
    a process's imported modules, classes and functions are most of its objects, and each full
    collection walks them all (about 0.14 s on the reference CPU with torch, pandas and plotly
    imported; `free_device_memory` collects after every variant). `free_device_memory` calls
    it whenever modules were imported since the last call (a process's first variant, or one
    that imports peft, torchao or transformers), and a report kernel before each notebook: what
    is frozen then lives on anyway. At exit it is handed back, so that the interpreter's last
    collection frees it (extensions such as triton's count what was never freed and say so on
    stderr)."""
    global _frozen_with
    gc.collect()
    gc.freeze()
    _frozen_with = len(sys.modules)
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)


_frozen_with = 0  # how many modules were imported at the last freeze_survivors


def free_device_memory(device: str) -> None:
    """Drop unreachable tensors (and, on CUDA, the allocator's cached blocks). Where modules
    were imported since the last `freeze_survivors`, what survives is frozen with them: in a
    fresh report kernel, 30_finetune's memory search otherwise took three times as long."""
    if len(sys.modules) != _frozen_with:
        freeze_survivors()
    else:
        gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def fits_in_memory(run: Callable[[], bool | None], device: str) -> bool:
    """Whether `run()` completes without running out of memory (and does not return False);
    other errors propagate. Afterwards nothing it allocated is alive: its frames, and on an OOM
    the traceback that holds them, are gone before the device's memory is freed."""
    try:
        fits = run() is not False
    except (torch.OutOfMemoryError, RuntimeError) as e:  # RuntimeError: the CPU allocator's
        if not is_out_of_memory(e):
            raise
        fits = False
    free_device_memory(device)
    return fits


# Ops that only cast, view or transpose: a saved tensor reached from a parameter through these
# alone is a copy of a weight (autocast's 16-bit casts), not an activation.
_WEIGHT_COPY_OPS = {"ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0",
                    "PermuteBackward0", "ExpandBackward0", "UnsafeViewBackward0"}


class SavedTensorMeter:
    """Tensors autograd saves for backward inside the block, each storage once, leaving out
    `exclude` (the parameters, which are resident anyway). Copies of those parameters (autocast's
    16-bit weight casts) are counted apart from activations, in `weight_copy_bytes`; with
    `gathered`, so is any saved tensor reached from a leaf that requires grad (FSDP2's gathered
    parameters, made during the forward, are such leaves)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, gathered: bool = False):
        self.gathered = gathered
        self.excluded = storage_keys(exclude)
        self.seen: set[int] = set()
        self.weight_copies: set[int] = set()  # their storages (`storage_keys`)
        self.weight_copy_by_dtype: collections.Counter[str] = collections.Counter()
        self.by_dtype: collections.Counter[str] = collections.Counter()
        self.by_producer: collections.Counter[str] = collections.Counter()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._count(t)
        # Detached: a saved output that referenced its own grad_fn would make a reference cycle
        # through C++ that the garbage collector cannot see, and the graph would never be freed.
        return t.detach()

    def _count(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st is None or st._cdata in self.excluded or st._cdata in self.seen:
            return
        self.seen.add(st._cdata)
        dtype = _dtype_name(t)
        if self._is_weight_copy(t.grad_fn):
            self.weight_copies.add(st._cdata)
            self.weight_copy_by_dtype[dtype] += st.nbytes()
            return
        producer = t.grad_fn.name() if t.grad_fn is not None else "input"
        self.by_dtype[dtype] += st.nbytes()
        self.by_producer[f"{producer} ({dtype})"] += st.nbytes()

    def _is_weight_copy(self, node) -> bool:
        while node is not None and node.name() in _WEIGHT_COPY_OPS:
            inputs = [n for n, _ in node.next_functions if n is not None]
            if len(inputs) != 1:
                return False
            node = inputs[0]
            if node.name() == "torch::autograd::AccumulateGrad":
                st = _storage(node.variable)
                return self.gathered or (st is not None and st._cdata in self.excluded)
        return False

    @property
    def weight_copy_bytes(self) -> int:
        return sum(self.weight_copy_by_dtype.values())

    @property
    def total_bytes(self) -> int:
        """Activation bytes: everything saved except the parameters and copies of them."""
        return sum(self.by_dtype.values())


class ActivationMeter:
    """What one forward pass leaves held for backward: every storage created during the forward
    and still alive at its end (so also what checkpointing keeps, which saved-tensor hooks cannot
    see), less the forward's own output, with autocast's weight copies counted apart. `exclude`:
    the resident tensors (the parameters). With `gathered` (FSDP2), the parameters as the module
    holds them after the forward are left out too (FSDP2 registers the gathered ones in place of
    the shards), and copies of those count as weight copies (`SavedTensorMeter`).
    `weight_copy_bytes`: the weight copies' storages still held at the forward's end, the
    parameters' own left out (a saved view of a gathered parameter is that parameter)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = (), *, gathered: Callable[[], Iterable[torch.Tensor]]
                 | None = None):
        self.exclude, self.gathered = list(exclude), gathered
        self.by_dtype: collections.Counter[str] = collections.Counter()
        self.weight_copy_bytes = 0
        self.largest: list[tuple[str, int]] = []  # the biggest saved tensors, by producing op

    def measure(self, forward: Callable[[], object]) -> "ActivationMeter":
        """Run `forward` and read what it left alive (`let_go_of_collectives` first)."""
        tracker = LiveTensorTracker()
        saved = SavedTensorMeter(self.exclude, gathered=self.gathered is not None)
        with tracker, saved:
            out = forward()
            # Each storage once, as it is at the forward's end: a saved copy that is a view of a
            # gathered parameter is that parameter's storage (not held twice), and one that FSDP2
            # resized to 0 when it resharded after the forward holds nothing.
            skip = storage_keys([*(self.gathered() if self.gathered else ()),
                                 *(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))])
            let_go_of_collectives(tracker, held=saved.seen | skip)
        copies = saved.weight_copies - skip
        self.by_dtype = +tracker.live_by_dtype(skip | copies)  # unary +: no empty dtypes
        self.weight_copy_bytes = sum(tracker.live_by_dtype(only=copies).values())
        self.largest = saved.by_producer.most_common(4)
        del out
        return self

    @property
    def total_bytes(self) -> int:
        return sum(self.by_dtype.values())


# How long a collective's buffer that nothing the meter sees holds may take to be let go of: one
# scheduler period of a CPU quota (100 ms) and as much again, counted in polls of POLL_S
COLLECTIVE_LET_GO_S, POLL_S = 0.2, 0.001


def let_go_of_collectives(tracker: LiveTensorTracker, held: set[int],
                          timeout_s: float = COLLECTIVE_LET_GO_S) -> None:
    """Wait, at most `timeout_s`, until every storage made in the meter that a collective read
    or made is freed, unless something the meter sees holds it (`held`: saved for backward, the
    forward's output, a gathered parameter) or it holds nothing (resized to 0). gloo's worker
    threads let go of a finished collective's input and output just after the waiting thread
    returns: the logits' all-gather (the head's local shard and the gathered copy) left 768 KiB
    alive at tensor parallelism's forward end in 13 of 144 measurements; Ulysses' all-to-all
    (c10d's op) kept its send buffer, a query's own storage at batch 1, alive after 70 of 2,000
    calls on two busy cores, and a rank's activations once measured 32 KiB (that query) over
    the plan. A barrier only narrowed that race (gloo has two worker threads, and it can end on
    the other one); this waits for the worker itself, for at most `timeout_s` of polls. A
    buffer held where the meter cannot see (on tensor parallelism, one all-reduce's output a
    forward) counts, as before, and costs this wait.

    The wait is counted in this loop's own polls, not read off the clock: time this process
    spends off the CPU (a quota's pauses, a busy host) does not use it up."""
    for _ in range(round(timeout_s / POLL_S)):
        if not any(tracker.live.get(key) and key not in held for key in tracker.collective_buffers):
            return
        time.sleep(POLL_S)  # the worker needs the GIL to drop its last reference


class _Saved:
    """One tensor autograd saved; dropped when autograd releases it (its graph freed)."""

    def __init__(self, t: torch.Tensor):
        # Detached: a saved output that referenced its own grad_fn would make a reference cycle
        # through C++ that the garbage collector cannot see, and the graph would never be freed.
        self.t = t.detach()


def _unpack(saved: _Saved | torch.Tensor) -> torch.Tensor:
    return saved.t if isinstance(saved, _Saved) else saved


class SavedBytes:
    """The peak, while inside, of the bytes autograd holds saved for backward: each storage
    counted once while any saved tensor on it is held, from the pack to the release of the last
    such saved tensor (its graph freed by a backward, or by the weight-gradient step of a split
    one), the `exclude`d tensors (the parameters) left out. Unlike a storage's own lifetime, a
    buffer reused across micro-batches (a stage's receive buffer) counts only while saved."""

    def __init__(self, exclude=()):
        self.excluded = storage_keys(exclude)
        self.holders: dict[int, list[int]] = {}  # held storage -> [bytes, saved tensors on it]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor) -> _Saved | torch.Tensor:
        st = t.untyped_storage()
        if st._cdata in self.excluded or t.device.type == "meta":
            return t
        holder = self.holders.setdefault(st._cdata, [st.nbytes(), 0])
        if holder[1] == 0:
            self.current += holder[0]
            self.peak = max(self.peak, self.current)
        holder[1] += 1
        saved = _Saved(t)
        weakref.finalize(saved, self._release, st._cdata)
        return saved

    def _release(self, key: int) -> None:
        holder = self.holders[key]
        holder[1] -= 1
        if holder[1] == 0:  # forgotten: a later storage may reuse its address
            self.current -= self.holders.pop(key)[0]
