"""`labkit.reference` is `labkit.blocks.reference` (moved there; this name keeps working). The module itself, not a copy:
both names are one module object, so what is set on one is seen through the other."""
import sys

from labkit.blocks import reference

sys.modules[__name__] = reference
