"""`labkit.techniques.kv_caches` is `labkit.blocks.kv_caches` (moved there; this name keeps working). The module itself, not a copy:
both names are one module object, so what is set on one is seen through the other."""
import sys

from labkit.blocks import kv_caches

sys.modules[__name__] = kv_caches
