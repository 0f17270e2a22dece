"""`labkit.experiment` is `labkit.harness.experiment` (moved there; this name keeps working). The module itself, not a copy:
both names are one module object, so what is set on one is seen through the other."""
import sys

from labkit.harness import experiment

sys.modules[__name__] = experiment
