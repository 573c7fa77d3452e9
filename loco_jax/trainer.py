"""Old import path of the trainer, now split across :mod:`loco_jax.training` (re-exports of its public names), kept for users' existing scripts."""

from loco_jax.training.checkpoints import INFLIGHT, restore_elastic  # noqa: F401
from loco_jax.training.loop import train_and_evaluate  # noqa: F401
from loco_jax.training.metrics import plot, read_metrics, summary_table  # noqa: F401
from loco_jax.training.steps import (  # noqa: F401
    BATCH_SPEC, TrainState, eval_step, learning_rate_schedule, make_optimizer, model_config, train_step,
)
from loco_jax.training.trainer import Dataset, Trainer  # noqa: F401
