"""Vanilla DiLoCo: 2 replicas x 4 data devices, one fragment, no overlap, fp32 outer exchange.

Measured (benchmarks/parity.py, docs/results.md): at the 919k-parameter benchmark model (bytes of
Shakespeare, 16 x 64 tokens per step, 3,000 steps, M = 2, H = 30), outer Nesterov lr 0.7 with outer
momentum 0.8 and the inner AdamW at lr 3e-3 was the best of the tuned cells on seed 0, and on seeds 1-3 it
ended +1.16 % (mean; +0.36, +0.28, +2.85 %) from data parallel at its own best lr (2e-3). The library
default momentum (0.9) measured +0.6 % worse on seed 0. Only that scale was measured: at other model sizes,
batches or run lengths, tune again (the DiLoCo scaling-law paper, arXiv 2503.09799, retunes per scale).
"""

from loco_jax.config import Config


def get_config() -> Config:
    cfg = Config(steps=300, batch_size=32, seq_len=128)
    cfg.mesh.replicas = 2
    cfg.diloco.enabled = True
    cfg.diloco.sync_every = 30
    return cfg
