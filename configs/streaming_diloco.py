"""Streaming DiLoCo: 2 replicas x 4 data devices, 3 fragments, overlap 1, alpha 0.5, 4-bit outer exchange."""

from loco_jax.config import Config


def get_config() -> Config:
    cfg = Config(steps=300, batch_size=32, seq_len=128)
    cfg.mesh.replicas = 2
    cfg.diloco.enabled = True
    cfg.diloco.sync_every = 30
    cfg.diloco.num_fragments = 3
    cfg.diloco.overlap = 1
    cfg.diloco.alpha = 0.5
    cfg.diloco.bits = 4
    return cfg
