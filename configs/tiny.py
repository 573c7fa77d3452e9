"""The demo: Streaming DiLoCo over 2 replicas x 4 data-parallel devices, LoCo 4-bit inside each replica.

A small byte-level transformer on Shakespeare; a few minutes on 2 CPU cores.
    python train.py --config configs/tiny.py
"""

from loco_jax.config import Config


def get_config() -> Config:
    cfg = Config(steps=300, batch_size=32, seq_len=128, eval_every=50, checkpoint_every=100, log_every=10)
    cfg.mesh.replicas = 2  # 2 replicas x 4 data devices on the 8 simulated CPU devices
    cfg.loco.bits = 4  # LoCo 4-bit gradient all-reduce inside each replica
    cfg.diloco.enabled = True
    cfg.diloco.sync_every = 30  # H
    cfg.diloco.num_fragments = 3  # embeddings/head, then layers strided over 2 fragments
    cfg.diloco.overlap = 1
    cfg.diloco.alpha = 0.5
    cfg.diloco.bits = 4  # 4-bit outer-gradient exchange
    cfg.diloco.outer_lr = 0.7
    return cfg
