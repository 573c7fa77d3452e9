"""Baseline: data parallel over all 8 devices, exact fp32 gradient all-reduce."""

from loco_jax.config import Config


def get_config() -> Config:
    return Config(steps=300, batch_size=32, seq_len=128)
