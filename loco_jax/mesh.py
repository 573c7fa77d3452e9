"""Old import path of :mod:`loco_jax.training.mesh`, kept for users' existing scripts (the same module object, so attributes and patches agree; the project itself imports ``loco_jax.training.mesh``)."""

import sys

from loco_jax.training import mesh as _module

sys.modules[__name__] = _module
