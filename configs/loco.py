"""Data parallel over all 8 devices with LoCo 4-bit gradient all-reduce."""

from loco_jax.config import Config


def get_config() -> Config:
    cfg = Config(steps=300, batch_size=32, seq_len=128)
    cfg.loco.bits = 4
    return cfg
