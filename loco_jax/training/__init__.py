"""The training application: config, mesh, model, data and the trainer built on the library.

The library (``loco_jax.quant``, ``collectives``, ``loco``, ``diloco``, ``fragments``, ``specs``, ``hlo``)
imports nothing from here. Modules, in the order a config flows through them:

- :mod:`~loco_jax.training.config`: the ``Config`` dataclasses, ``configs/*.py`` loading, validation;
- :mod:`~loco_jax.training.mesh`: ``jax.distributed`` start-up and the ``(replica, data)`` mesh;
- the data, one module per job: :mod:`~loco_jax.training.corpus` (texts and the held-out split),
  :mod:`~loco_jax.training.tokenizers`, :mod:`~loco_jax.training.tokens` (token files, ``load_data``) and
  :mod:`~loco_jax.training.batches` (restartable batches, eval windows);
- token shard directories made by ``prepare_data.py``: :mod:`~loco_jax.training.shard_format` (the
  directory and its manifest), :mod:`~loco_jax.training.shard_reader`, :mod:`~loco_jax.training.shard_writer`
  and :mod:`~loco_jax.training.prepare` (the pipeline);
- :mod:`~loco_jax.training.dataset`: a run's token streams and this process's rows of a batch;
- :mod:`~loco_jax.training.shapes`: the model's dimensions and parameter tree, the one description;
- :mod:`~loco_jax.training.model`: the LLaMA-style Flax model and its loss;
- :mod:`~loco_jax.training.strategy`: data parallel or Streaming DiLoCo, what the trainer asks of each;
- :mod:`~loco_jax.training.steps`: the optimizer of a config, ``train_step`` and ``eval_step``;
- :mod:`~loco_jax.training.trainer`: the ``Trainer`` (mesh, data, compiled programs, state);
- :mod:`~loco_jax.training.loop`: ``train_and_evaluate``, a run as a short loop over named periodic actions;
- :mod:`~loco_jax.training.failure`: a dead peer process or a hung step ends the run with one message;
- :mod:`~loco_jax.training.checkpoints`: orbax checkpoints and elastic restore;
- :mod:`~loco_jax.training.metrics`: ``metrics.jsonl``, the summary table, the plot, progress;
- :mod:`~loco_jax.training.sample`: text generated from the global parameters (end of a run);
- :mod:`~loco_jax.training.sample_command`: ``train.py --sample``, a checkpoint's samples without training.
"""
