"""Old import path of :mod:`loco_jax.training.model`, kept for users' existing scripts (the same module object, so attributes and patches agree; the project itself imports ``loco_jax.training.model``)."""

import sys

from loco_jax.training import model as _module

sys.modules[__name__] = _module
