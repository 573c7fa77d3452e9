"""Vanilla DiLoCo: 2 replicas x 4 data devices, one fragment, no overlap, fp32 outer exchange.

Runs what was measured: benchmarks/parity.py's tuned DiLoCo cells at M = 2 (the 919k-parameter
default model, bytes of Shakespeare, 16 x 64 tokens per step, 3,000 steps, H = 30). Moving one setting
at a time from the paper's defaults on seed 0, outer momentum 0.8 (outer Nesterov lr 0.7, inner AdamW
lr 3e-3) did best; on seeds 1-3 it ended +1.16 % (mean; +0.36, +0.28, +2.85 %) from data parallel at
its own best lr (configs/ddp.py). The library's default momentum (0.9) measured +0.6 % worse on seed 0.
Only that scale was measured: at other model sizes, batches or run lengths, tune again (the DiLoCo
scaling-law paper, arXiv 2503.09799, retunes per scale). Reproduce: python benchmarks/parity.py --list
(cells par_m2_diloco_momentum0.8_s0 ... _s3); docs/results.md, "Streaming DiLoCo at parity".

Settings:
    steps=3000 batch_size=16 seq_len=64 eval_every=300 eval_batches=16 log_every=10 checkpoint_every=600
    mesh.replicas=2 diloco.enabled=true diloco.sync_every=30 diloco.num_fragments=1 diloco.overlap=0
    diloco.alpha=0.0 diloco.bits=None diloco.outer_lr=0.7 diloco.outer_momentum=0.8 optim.lr=0.003
"""

from loco_jax.training.run.config import Config


def get_config() -> Config:
    cfg = Config(steps=3000, batch_size=16, seq_len=64, eval_every=300, eval_batches=16, log_every=10,
                 checkpoint_every=600)
    cfg.optim.lr = 3e-3
    cfg.mesh.replicas = 2
    d = cfg.diloco
    d.enabled, d.sync_every, d.num_fragments, d.overlap, d.alpha, d.bits = True, 30, 1, 0, 0.0, None
    d.outer_lr, d.outer_momentum = 0.7, 0.8
    return cfg
