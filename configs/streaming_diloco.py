"""Streaming DiLoCo: 2 replicas x 4 data devices, 3 fragments, overlap 1, alpha 0.5, 4-bit outer exchange.

Measured (benchmarks/parity.py, docs/results.md): at the 919k-parameter benchmark model (bytes of
Shakespeare, 16 x 64 tokens per step, 3,000 steps, H = 30, 3 fragments, overlap 1, 4-bit exchange), the best
tuned settings on seed 0 were, at M = 2, outer lr 0.7, outer momentum 0.8, alpha 0 and inner lr 5e-3
(data parallel's best: 2e-3); on seeds 1-3 they ended +0.33 % (mean; +0.36, -0.88, +1.52 %) from data
parallel, where these defaults (momentum 0.9, alpha 0.5, lr 3e-3) were +2.78 % on seed 0. At M = 4: alpha 0
and inner lr 5e-3 (+3.99 % on seed 0; +2.49 % mean of seeds 1-3: +2.48, +1.26, +3.73 %, above the +2 %
the issue asked for, and shrinking with run length: +13 % at 510 steps; an exact fp32 exchange at the same
settings measured +2.59 %, so the exchange is not what keeps it there). Those runs used the int absmax 4-bit
exchange, the default then; diloco.bits=4 now resolves to rotated Lloyd-Max levels, which measured the same
at these settings (M = 2 +0.33 %: +0.57, -0.31, +0.74 %; M = 4 +2.54 %). Only that scale was measured: tune
again at others.
"""

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
