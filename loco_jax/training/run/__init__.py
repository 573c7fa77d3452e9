"""A run of ``train.py``: config, mesh, dataset, strategy, steps, trainer, loop, failure, checkpoints, metrics, samples."""
