"""The training application: config, mesh, model, data and the trainer built on the library.

The library (``loco_jax.quant``, ``collectives``, ``loco``, ``diloco``, ``fragments``, ``specs``, ``hlo``)
imports nothing from here. Modules, in the order a config flows through them:

- :mod:`~loco_jax.training.config`: the ``Config`` dataclasses, ``configs/*.py`` loading, validation;
- :mod:`~loco_jax.training.mesh`: ``jax.distributed`` start-up and the ``(replica, data)`` mesh;
- :mod:`~loco_jax.training.data`: corpora, tokenizers, token files and restartable batches;
- :mod:`~loco_jax.training.shards`: token shard directories (manifest, writer, memory-mapped reader),
  made by ``prepare_data.py``;
- :mod:`~loco_jax.training.dataset`: a run's token streams and this process's rows of a batch;
- :mod:`~loco_jax.training.model`: the LLaMA-style Flax model and its loss;
- :mod:`~loco_jax.training.steps`: the optimizer of a config, ``train_step`` and ``eval_step``;
- :mod:`~loco_jax.training.trainer`: the ``Trainer`` (mesh, data, compiled programs, state);
- :mod:`~loco_jax.training.loop`: ``train_and_evaluate``, the loop;
- :mod:`~loco_jax.training.failure`: a dead peer process or a hung step ends the run with one message;
- :mod:`~loco_jax.training.checkpoints`: orbax checkpoints and elastic restore;
- :mod:`~loco_jax.training.metrics`: ``metrics.jsonl``, the summary table, the plot, progress;
- :mod:`~loco_jax.training.sample`: text generated from the global parameters (end of a run, ``--sample``).
"""
