"""The memory of one training step over time, by category, with the step's phase marks.

    recorder = make_recorder(device)
    with recorder.recording(parameters=..., optimizer_state=..., batch=...):
        recorder.mark("forward"); ...; recorder.mark("backward"); ...
        recorder.mark("optimizer", gradients=[p.grad for p in params]); ...
    timeline = recorder.timeline()   # samples (one per allocation, free or resize) and marks

Categories, each storage in exactly one (bytes are storage bytes, each storage once):
- `parameters`, `optimizer_state`: the storages of the tensors the caller names, by identity
  (the optimizer's moments and step counters; CopyAdamW's master copies too);
- `gradients`: the storages that are the parameters' `.grad` when the optimizer starts (named
  at the `optimizer` mark), from their allocation in backward on;
- `activations`: what a forward leaves held for backward: storages made during a forward and
  still live when its backward starts. That is what autograd saves, and also what checkpointing
  keeps (its blocks' inputs), which saved-tensor hooks cannot see (the checkpoint's own hooks
  take over inside it). The batch (token ids; the embedding and the loss save them) counts here,
  and so do autocast's cached 16-bit weight casts (the planner's `weight_copy_bytes`).
  Tensors a checkpointed block recomputes in backward are temporaries, as the planner counts them;
- `temporaries`: everything else: the forward's short-lived intermediates, the backward's
  working gradients, the optimizer step's scratch tensors.

The events are categorised after the step (`categorise`), once every identity is known, so a
gradient counts as a gradient from its allocation on. Two sources, one event format:
- CPU (any device, in fact): the live-tensor tracker, a dispatch mode that sees every storage an op
  makes and its free; totals are the tracker's own running count.
- CUDA: the caching allocator's history (`torch.cuda.memory._record_memory_history` and
  `_snapshot()`, private API kept here in measure/; documented at
  https://pytorch.org/docs/stable/torch_cuda_memory.html; comparing two snapshots is
  https://github.com/pytorch/pytorch/issues/120245). Sizes are the allocator's blocks (rounded
  up to 512 bytes). This path has not been run on a GPU from this checkout.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np
import pandas as pd
import torch

from labkit.measure.memory import LiveTensorTracker, _storage, inner_tensors

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
PHASES = ("forward", "backward", "optimizer")  # the marks a step is aligned at, in order
START = "start"  # the phase of the first sample: what is resident before the step
# An event: (kind, key, value). kind: "alloc" (value: bytes), "free", "resize" (value: new
# bytes), "mark" (key: the phase), "claim" (value: the category of the storage at key).
Event = tuple[str, object, object]


@dataclass
class Timeline:
    """One recorded step. `samples`: one row per sample (`sample`, `phase`, `micro_batch`,
    `total_bytes` and one bytes column per category); row 0 is the resident state before the
    step, each later row follows one allocation, free or resize. `marks`: (phase, first sample
    of it) for every mark in order (a phase repeats once per micro-batch)."""

    samples: pd.DataFrame
    marks: list[tuple[str, int]]
    device: str

    def peak_bytes(self, category: str | None = None) -> int:
        column = "total_bytes" if category is None else category
        return int(self.samples[column].max())


def categorise(events: Iterable[Event], totals: Iterable[int] | None = None) -> tuple[pd.DataFrame, list]:
    """Replay `events` into per-category bytes after each sample (see `Timeline`). The events
    before the first mark are the resident state (one sample). `totals`, one per sample, are
    the recorder's own running count (the CPU tracker's), kept as `total_bytes`; without them
    the total is the categories' sum."""
    replay = _Replay()
    for event in events:
        replay.apply(event)
    samples = replay.frame()
    if totals is not None:
        samples["total_bytes"] = np.asarray(list(totals), dtype=np.int64)
    return samples, replay.marks


class _Replay:
    """Walks the events: a serial per allocation (an address is reused after a free), the
    category each serial ends with, and each sample's (serial, change in bytes)."""

    def __init__(self):
        self.live: dict[object, int] = {}  # key -> serial of the storage now there
        self.size: list[int] = []  # per serial, its bytes now
        self.category: dict[int, str] = {}
        self.deltas: list[list[tuple[int, int]]] = [[]]  # per sample: its changes (row 0: resident)
        self.phase, self.micro_batch, self.phases = START, 0, [(START, 0)]
        self.marks: list[tuple[str, int]] = []
        self.forward_from: int | None = None  # the first serial made in the running forward

    def apply(self, event: Event) -> None:
        kind, key, value = event
        if kind == "mark":
            self._mark(key)
        elif kind == "claim":
            serial = self.live.get(key)
            if serial is not None:  # the first claim wins: parameters before gradients
                self.category.setdefault(serial, value)
        elif kind == "alloc":
            self.live[key] = len(self.size)
            self.size.append(int(value))
            self._sample(self.live[key], int(value))
        elif kind in ("free", "resize") and key in self.live:
            serial = self.live.pop(key) if kind == "free" else self.live[key]
            new = 0 if kind == "free" else int(value)
            self._sample(serial, new - self.size[serial])
            self.size[serial] = new

    def _sample(self, serial: int, delta: int) -> None:
        if self.marks:
            self.deltas.append([])
            self.phases.append((self.phase, self.micro_batch))
        self.deltas[-1].append((serial, delta))

    def _mark(self, phase: str) -> None:
        if self.forward_from is not None:  # a forward ends: what it made and still holds
            for serial in self.live.values():
                if serial >= self.forward_from:
                    self.category.setdefault(serial, "activations")
            self.forward_from = None
        if phase == "forward":
            self.forward_from = len(self.size)
            self.micro_batch += self.phase != START
        self.phase = phase
        self.marks.append((phase, len(self.deltas)))

    def frame(self) -> pd.DataFrame:
        index = {c: i for i, c in enumerate(CATEGORIES)}
        change = np.zeros((len(self.deltas), len(CATEGORIES)), dtype=np.int64)
        for row, deltas in enumerate(self.deltas):
            for serial, delta in deltas:
                change[row, index[self.category.get(serial, "temporaries")]] += delta
        frame = pd.DataFrame(np.cumsum(change, axis=0), columns=list(CATEGORIES))
        frame.insert(0, "sample", np.arange(len(frame)))
        frame.insert(1, "phase", [p for p, _ in self.phases])
        frame.insert(2, "micro_batch", [m for _, m in self.phases])
        frame["total_bytes"] = frame[list(CATEGORIES)].sum(axis=1)
        return frame


# --- Recorders: the same interface on the CPU tracker and the CUDA allocator ---------------------

class StepRecorder:
    """Collects the events of one step. `recording(...)` names the resident tensors by category
    (their storages are the first events), `mark(phase, gradients=...)` marks a phase's start
    and names the gradients; `timeline()` categorises what was recorded."""

    def __init__(self, device: str = "cpu"):
        self.device = device
        self.events: list[Event] = []

    def _key(self, t: torch.Tensor):
        st = _storage(t)
        return None if st is None else st._cdata

    def _claims(self, tensors: Iterable[torch.Tensor], category: str) -> list[Event]:
        return [("claim", key, category) for t in tensors
                if isinstance(t, torch.Tensor) and (key := self._key(t)) is not None]

    def mark(self, phase: str, *, gradients: Iterable[torch.Tensor] = ()) -> None:
        self.events += [("mark", phase, None), *self._claims(gradients, "gradients")]

    def timeline(self) -> Timeline:
        samples, marks = categorise(self.events, self._totals())
        return Timeline(samples, marks, self.device)

    def _totals(self) -> list[int] | None:
        return None


class _LoggingTracker(LiveTensorTracker):
    """The live-tensor tracker, logging every allocation, free and resize (with its running
    total) while `on`."""

    def __init__(self, events: list[Event]):
        super().__init__()
        self.events, self.totals, self.on = events, [], False

    def _log(self, kind: str, key: int, value) -> None:
        if self.on:
            self.events.append((kind, key, value))
            self.totals.append(self.current_bytes)

    def _track(self, t: torch.Tensor, inputs: set[int] = frozenset()) -> None:
        st = _storage(t)
        new = st is not None and st._cdata not in self.live and st._cdata not in inputs
        super()._track(t, inputs)
        if new:
            self._log("alloc", st._cdata, st.nbytes())

    def _free(self, key: int) -> None:
        tracked = key in self.live
        super()._free(key)
        if tracked:
            self._log("free", key, 0)

    def _resized(self, st: torch.UntypedStorage) -> None:
        super()._resized(st)
        if st._cdata in self.live:
            self._log("resize", st._cdata, st.nbytes())


class TrackerRecorder(StepRecorder):
    """The CPU path: the live-tensor tracker's storages (it works on any device's tensors)."""

    @contextlib.contextmanager
    def recording(self, *, parameters=(), optimizer_state=(), batch=()) -> Iterator["TrackerRecorder"]:
        self.events = []
        self.tracker = _LoggingTracker(self.events)
        self.tracker.on = True
        with self.tracker:
            for category, tensors in (("parameters", parameters), ("optimizer_state", optimizer_state),
                                      ("activations", batch)):
                # a wrapper subclass (8-bit optimizer states) by the tensors that hold its bytes
                tensors = [t for t in inner_tensors(tensors) if isinstance(t, torch.Tensor)]
                for t in tensors:
                    self.tracker._track(t)
                self.events += self._claims(tensors, category)
            try:
                yield self
            finally:
                self.tracker.on = False

    def _totals(self) -> list[int]:
        # row 0 is the resident state: the total after the last event before the first mark
        first = next((i for i, e in enumerate(self.events) if e[0] == "mark"), len(self.events))
        resident = sum(1 for e in self.events[:first] if e[0] in ("alloc", "free", "resize"))
        totals = self.tracker.totals
        return ([totals[resident - 1] if resident else 0] + totals[resident:])


class CudaRecorder(StepRecorder):
    """The CUDA path: the caching allocator's alloc and free history. Marks take a snapshot,
    which the allocator records in its history as a "snapshot" entry: that is where the mark
    falls among the allocations. Keys are block addresses (a storage's data_ptr)."""

    def _key(self, t: torch.Tensor):
        st = _storage(t)
        return None if st is None or st.nbytes() == 0 else st.data_ptr()

    @contextlib.contextmanager
    def recording(self, *, parameters=(), optimizer_state=(), batch=()) -> Iterator["CudaRecorder"]:
        self.resident: list[Event] = []
        for category, tensors in (("parameters", parameters), ("optimizer_state", optimizer_state),
                                  ("activations", batch)):
            for t in inner_tensors(tensors):
                st = _storage(t) if isinstance(t, torch.Tensor) else None
                if st is not None and st.nbytes():
                    self.resident += [("alloc", st.data_ptr(), st.nbytes()),
                                      ("claim", st.data_ptr(), category)]
        self.claims: list[list[Event]] = []
        torch.cuda.synchronize(self.device)
        torch.cuda.memory._record_memory_history("all", context=None, clear_history=True)
        try:
            yield self
            torch.cuda.synchronize(self.device)
            self.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(None)

    def mark(self, phase: str, *, gradients: Iterable[torch.Tensor] = ()) -> None:
        self.claims.append([("mark", phase, None), *self._claims(gradients, "gradients")])
        torch.cuda.memory._snapshot()  # a "snapshot" entry in the history: the mark's place

    def timeline(self) -> Timeline:
        index = torch.device(self.device).index or 0
        trace = self.snapshot["device_traces"][index]
        samples, marks = categorise(self.resident + cuda_events(trace, self.claims))
        return Timeline(samples, marks, self.device)


def cuda_events(trace: list[dict], claims: list[list[Event]]) -> list[Event]:
    """The allocator's history as events: `alloc` and `free_completed` entries, and at the i-th
    `snapshot` entry the i-th mark's events (its mark and claims). A block freed that was not
    allocated inside the history (before recording) is ignored by the replay."""
    events, marks = [], iter(claims)
    for entry in trace:
        action = entry.get("action")
        if action == "alloc":
            events.append(("alloc", entry["addr"], entry["size"]))
        elif action == "free_completed":
            events.append(("free", entry["addr"], 0))
        elif action == "snapshot":
            events += next(marks, [])
    return events


def make_recorder(device: str) -> StepRecorder:
    """The recorder for `device`: the allocator's history on CUDA, the live-tensor tracker elsewhere."""
    return CudaRecorder(device) if str(device).startswith("cuda") else TrackerRecorder(device)
