"""Data parallel over all 8 devices, exact fp32 gradient all-reduce: the baseline the DiLoCo configs compare to.

Runs what was measured: benchmarks/parity.py's data-parallel cells (the 919k-parameter default model,
bytes of Shakespeare, 16 sequences x 64 tokens per step, 3,000 steps, AdamW with warm-up and cosine
decay). Of the learning rates tried on seed 0 (1e-3, 2e-3, 3e-3, 5e-3), 2e-3 ended lowest (eval loss
1.6587; docs/results.md, "Streaming DiLoCo at parity"), and every DiLoCo gap in configs/diloco.py and
configs/streaming_diloco.py is to data parallel at this rate, seeds 1-3. About 10 minutes on 2 CPU cores.
Reproduce: python benchmarks/parity.py --list (cells par_dp_lr0.002_s0 ... _s3).

Settings:
    steps=3000 batch_size=16 seq_len=64 eval_every=300 eval_batches=16 log_every=10 checkpoint_every=600
    mesh.replicas=1 diloco.enabled=false loco.bits=None optim.lr=0.002
"""

from loco_jax.training.run.config import Config


def get_config() -> Config:
    cfg = Config(steps=3000, batch_size=16, seq_len=64, eval_every=300, eval_batches=16, log_every=10,
                 checkpoint_every=600)
    cfg.optim.lr = 2e-3
    return cfg
