"""AdamW with its two moments kept in 8 or 4 bits: torchao's `AdamW8bit` and `AdamW4bit`.

Each moment of a parameter of at least 4096 elements (and a multiple of the block) is stored
block-wise: codes of 8 bits (4 bits, two to a byte) through a dynamic map of 256 (16) values
(Dettmers et al. 2021, arXiv 2110.02861; Li et al. 2023, arXiv 2309.01507), one fp32 absmax
scale per block of 256 (128) elements, and the map itself. Smaller parameters keep fp32 moments,
as bitsandbytes does. The update dequantizes both moments, makes AdamW's fp32 step and quantizes
them again, so the weights train as under AdamW with a rounding of the moments.

torchao compiles each parameter's update (one fused kernel). On a CPU that compile costs about
ten seconds before the first step, so there the update runs eagerly
(`torch.compiler.set_stance("force_eager")`): the same arithmetic, its temporaries unfused
(`planner.low_bit_update_bytes`).
"""
from __future__ import annotations

import functools

import torch

from labkit import planner

OPTIMIZERS = ("adamw", *planner.LOW_BIT)  # the low-bit ones: planner.LOW_BIT's storage of each
# Relative difference of the losses and weights from fp32 AdamW's after the same steps that still
# counts as a match. On the tiny preset (2 layers, 32 tokens, lr 1e-3) the weights differed by
# 2.8e-4 (8 bits) and 6.8e-3 (4 bits) after 2 steps, 2.2e-3 and 3.6e-2 after 10, 8.6e-3 and
# 0.13 after 30; tests/test_optimizers.py holds the 8-bit curve within 1% over 10 steps.
TOLERANCE = {"adamw": 0.0, "adamw8bit": 0.01, "adamw4bit": 0.05}


def missing_library(optimizer: str) -> str | None:
    """"torchao" where `optimizer` needs it and it does not import here, else None."""
    if optimizer not in planner.LOW_BIT:
        return None
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        return "torchao"
    return None


@functools.cache
def _eager(cls: type) -> type:
    """`cls` whose step runs its compiled update eagerly."""
    def step(self, closure=None):
        with torch.compiler.set_stance("force_eager"):
            return cls.step(self, closure)

    return type(f"Eager{cls.__name__}", (cls,), {"step": step, "__doc__": cls.__doc__})


def low_bit_adamw(params, lr: float, *, optimizer: str, compiled: bool) -> torch.optim.Optimizer:
    """torchao's AdamW with `optimizer`'s moments (adamw8bit, adamw4bit), torch's AdamW defaults
    (betas 0.9/0.999, eps 1e-8, weight decay 0.01); `compiled` False: the update eager."""
    from torchao.optim import AdamW4bit, AdamW8bit

    cls = {"adamw8bit": AdamW8bit, "adamw4bit": AdamW4bit}[optimizer]
    return (cls if compiled else _eager(cls))(params, lr=lr)
