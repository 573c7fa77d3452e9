"""``python train.py --sample``: the samples block of a workdir's latest checkpoint, without training.

It restores the checkpoint as the loop does (elastic restore included) on a Trainer built from the run's
own ``config.json``, then prints :func:`loco_jax.training.run.sample.print_samples`' block. The generation
itself is :mod:`loco_jax.training.run.sample`, which the loop also uses at the end of a run.
"""

from __future__ import annotations

import os

from loco_jax.training.run import config as config_lib
from loco_jax.training.run.checkpoints import (
    check_resume_config, checkpoint_manager, complete_checkpoint_steps, restore_step, saved_config,
)
from loco_jax.training.run.sample import print_samples
from loco_jax.training.run.trainer import Trainer

__all__ = ["latest_checkpoint_step", "restore_latest", "sample_workdir"]


def latest_checkpoint_step(workdir: str) -> int:
    """The newest finished checkpoint step on disk (``checkpoints/<int>/``), read without orbax or jax
    devices, so ``train.py --sample`` can fail early; raises ``FileNotFoundError`` naming what is missing.

    A folder named by an int is a finished one (:func:`~loco_jax.training.run.checkpoints.complete_checkpoint_steps`);
    :func:`restore_latest` asks orbax again.
    """
    folder = os.path.join(workdir, "checkpoints")
    steps = complete_checkpoint_steps(workdir)
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {folder}: --sample needs a trained run; train first with "
            f"`python train.py --config CONFIG --workdir {workdir}` (it checkpoints every checkpoint_every steps "
            "and at the end)."
        )
    if not os.path.isfile(os.path.join(workdir, "config.json")):
        raise FileNotFoundError(f"{workdir} has checkpoints but no config.json; --sample needs the run's config.")
    return steps[-1]


def restore_latest(trainer, workdir: str, log=print):
    """(state, meta) of the workdir's latest checkpoint, restored as the loop restores a run: on the mesh
    it was written on directly, on another mesh by the elastic restore. Raises ``FileNotFoundError``
    when orbax finds no complete checkpoint."""
    latest_checkpoint_step(workdir)  # before the manager, which would create checkpoints/
    manager = checkpoint_manager(workdir, trainer.cfg.keep_checkpoints)
    try:
        latest = manager.latest_step()
        if latest is None:
            raise FileNotFoundError(f"no complete checkpoint in {os.path.join(workdir, 'checkpoints')}.")
        return restore_step(manager, latest, trainer, log)
    finally:
        manager.close()


def sample_workdir(workdir: str, overrides=(), log=print, **kwargs) -> list[str] | None:
    """``python train.py --sample``: the samples block of the workdir's latest checkpoint, no training.

    The config is the run's own ``config.json``; ``overrides`` (``--set``) may change what does not
    touch the trained state (the mesh, for instance) and are refused otherwise, as on resume.
    ``kwargs`` go to :func:`~loco_jax.training.run.sample.print_samples` (``length``, ``temperature``, ``top_k``, ``seed``, ``prompts``,
    ``num``). Call it on every process of a multi-process run.
    """
    latest_checkpoint_step(workdir)
    saved = saved_config(workdir)
    cfg = config_lib.override(config_lib.from_dict(saved), overrides)
    config_lib.validate(cfg)
    cfg = config_lib.resolve(cfg, saved)
    check_resume_config(workdir, cfg, saved, log)
    trainer = Trainer(cfg, workdir, log)
    state, meta = restore_latest(trainer, workdir, log)
    return print_samples(trainer, state, log, step=meta["step"], **kwargs)
