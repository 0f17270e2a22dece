"""`labkit.model` is `labkit.blocks.model` (moved there; this name keeps working). The module itself, not a copy:
both names are one module object, so what is set on one is seen through the other."""
import sys

from labkit.blocks import model

sys.modules[__name__] = model
