"""Old import path of :mod:`loco_jax.training.data` (the same module object, so attributes and patches agree)."""

import sys

from loco_jax.training import data as _module

sys.modules[__name__] = _module
