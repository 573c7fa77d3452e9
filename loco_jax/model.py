"""Old import path of :mod:`loco_jax.training.model` (the same module object, so attributes and patches agree)."""

import sys

from loco_jax.training import model as _module

sys.modules[__name__] = _module
