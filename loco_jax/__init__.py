"""loco-jax: low-bit gradient communication (LoCo) and Streaming DiLoCo for JAX.

The library, which depends on jax, optax and numpy only:

- :mod:`~loco_jax.quant`: block quantizers, Hadamard rotation, ``uint8`` packing;
- :mod:`~loco_jax.collectives`: quantized all-reduce, reduce-scatter and all-gather under ``shard_map``;
- :mod:`~loco_jax.exchange`: the one idea as a value, compress, exchange, decode, keep the error:
  ``Exact``, ``Dense``, ``Sparse`` and the error step written once, which LoCo and DiLoCo are built from;
- :mod:`~loco_jax.loco`: ``loco.compress``, LoCo's error-compensated optax transformation;
- :mod:`~loco_jax.backward`: LoCo's exchange inside the backward pass of a scanned stack;
- :mod:`~loco_jax.diloco`: DiLoCo and Streaming DiLoCo, an outer optimizer over the ``replica`` axis;
- :mod:`~loco_jax.islands`: replicas as separate JAX jobs whose payloads cross through JAX's transfer server;
- :mod:`~loco_jax.sparse`: sparse payloads (each chunk's top-k entries) for DiLoCo's sparse exchange;
- :mod:`~loco_jax.fragments`: the fragments of a parameter tree that Streaming DiLoCo syncs in turn;
- :mod:`~loco_jax.nonfinite`: the non-finite rule, one flag per step agreed over named mesh axes;
- :mod:`~loco_jax.fsdp`: FSDP's shard layout, parameter gathers and clipping over every shard;
- :mod:`~loco_jax.specs`: ``PartitionSpec`` of state leaves from their varying axes;
- :mod:`~loco_jax.hlo`: wire bytes of every collective, read from compiled HLO;
- :mod:`~loco_jax.checks`: the argument checks the library and the application share.

The training application (config, mesh, data, model, trainer) is :mod:`loco_jax.training`; the
library imports nothing from it.
"""

from loco_jax import (backward, checks, collectives, diloco, exchange, fragments, fsdp, hlo, islands, loco, nonfinite,
                      quant, sparse, specs)

__all__ = ["backward", "checks", "collectives", "diloco", "exchange", "fragments", "fsdp", "hlo", "islands", "loco",
           "nonfinite", "quant", "sparse", "specs"]
__version__ = "0.1.0"
