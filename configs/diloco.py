"""Vanilla DiLoCo: 2 replicas x 4 data devices, one fragment, no overlap, fp32 outer exchange."""

from loco_jax.config import Config


def get_config() -> Config:
    cfg = Config(steps=300, batch_size=32, seq_len=128)
    cfg.mesh.replicas = 2
    cfg.diloco.enabled = True
    cfg.diloco.sync_every = 30
    return cfg
