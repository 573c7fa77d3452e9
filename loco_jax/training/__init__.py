"""The training application: config, mesh, model, data and the trainer built on the library.

The library (``loco_jax.quant``, ``collectives``, ``exchange``, ``loco``, ``diloco``, ``fragments``, ``specs``,
``hlo``) imports nothing from here. Three parts, each by its job:

- the model, here: :mod:`~loco_jax.training.shapes` (the model's dimensions and parameter tree, the one
  description) and :mod:`~loco_jax.training.model` (the LLaMA-style Flax model and its loss);
  :mod:`~loco_jax.training.progress` (progress lines, shared by the two parts below);
- :mod:`loco_jax.training.data`: texts to tokens to batches, with no run in sight: ``corpus`` (texts and the
  held-out split), ``tokenizers``, ``tokens`` (token files, ``load_data``), ``batches`` (restartable batches,
  eval windows), and the token shard directories that ``prepare_data.py`` makes: ``shard_format`` (the
  directory and its manifest), ``shard_reader``, ``shard_writer``, ``prepare`` (the pipeline);
- :mod:`loco_jax.training.run`: a run of ``train.py``, in the order a config flows through it: ``config``
  (the ``Config`` dataclasses, ``configs/*.py``, validation), ``mesh`` (``jax.distributed`` start-up, the
  mesh), ``dataset`` (the config's token streams, this process's rows of a batch), ``strategy`` (data
  parallel or Streaming DiLoCo), ``steps`` (the optimizer, ``train_step``, ``eval_step``), ``trainer``
  (mesh, data, compiled programs, state), ``loop`` (``train_and_evaluate`` as named periodic actions),
  ``failure`` (a dead peer or a hung step ends the run with one message), ``checkpoints`` (orbax, elastic
  restore), ``metrics`` (``metrics.jsonl``, the summary, the plot), ``sample`` and ``sample_command`` (text
  generated from the global parameters).
"""
