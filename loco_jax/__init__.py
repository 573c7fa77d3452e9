"""loco-jax: low-bit gradient communication (LoCo) and Streaming DiLoCo for JAX.

The library modules (``quant``, ``collectives``, ``loco``, ``hlo``) depend on
jax, optax and numpy only; the trainer, model and data code live apart.
"""

from loco_jax import collectives, hlo, loco, quant, specs

__all__ = ["collectives", "hlo", "loco", "quant", "specs"]
__version__ = "0.1.0"
