"""Our own GPU kernels, written in Triton.

Triton is optional: nothing in labkit imports it until a kernel is used, so the core runs without
it. Import `labkit.blocks.kernels.rmsnorm` only where a kernel is launched. With `TRITON_INTERPRET=1` set
before that import, the kernels run on CPU tensors through Triton's interpreter (slow, for tests).
"""
from __future__ import annotations

import importlib.util
import os


def triton_available() -> bool:
    """True when the `triton` package is installed (without importing it)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):  # ValueError: a blocked module (sys.modules entry None)
        return False


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
