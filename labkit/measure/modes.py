"""The meters' blind spots: how a technique steps outside them, or asks if it is in one.

The CPU memory tracker (`memory.LiveTensorTracker`) and the FLOP counter (torch's
`FlopCounterMode`) are TorchDispatchModes: while one is active every aten op passes through
Python on its way to the kernel. Two consequences reach the techniques:

- torch.compile does not compile under an active dispatch mode: Dynamo skips the frame and the
  function runs eager (`convert_frame`: "skip due to torch dispatch mode";
  https://github.com/pytorch/pytorch/issues/144787 explains why compile and modes do not mix).
  A compiled function that must be checked and timed as compiled runs `unmetered()`.
- a meter slows every op, a block's many small ops far more than one large matmul: a technique
  that calibrates itself by timing (a pipeline's cut) times `unmetered()`, and one that keeps
  timings of its own drops those taken while `is_metered()`.

What runs `unmetered()` is not counted: its allocations and FLOPs are invisible to the
dispatch-mode meters active around it (`SavedTensorMeter` is an autograd hook, not a mode: it
still sees what backward saves). PyTorch offers no public API to leave or inspect the mode stack
(https://github.com/pytorch/pytorch/issues/136495 asks for a way to turn a mode off and on;
`ignore_compile_internals`, https://github.com/pytorch/pytorch/pull/161648, only hides a mode
from compilation, and the meters here must count what runs). So this module is the one place in
labkit that touches the private `torch.utils._python_dispatch` stack functions
(tests/test_clock.py fails otherwise); if a release renames them, this file is the one to change.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode


@contextlib.contextmanager
def unmetered() -> Iterator[None]:
    """Run the block with every active TorchDispatchMode (the harness's memory tracker, a FLOP
    counter) taken off the stack, and put back, in order, at exit: no op inside is metered. (A
    storage resize is no op: the CPU tracker still follows one of a storage it already holds.)"""
    with _disable_current_modes():
        yield


def is_metered() -> bool:
    """Whether a TorchDispatchMode (a harness meter: memory tracker, FLOP counter) sees the ops
    run here, and slows them."""
    return _get_current_dispatch_mode() is not None
