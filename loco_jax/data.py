"""Old import path of :mod:`loco_jax.training.data`, kept for users' existing scripts (the same module object, so attributes and patches agree; the project itself imports ``loco_jax.training.data``)."""

import sys

from loco_jax.training import data as _module

sys.modules[__name__] = _module
