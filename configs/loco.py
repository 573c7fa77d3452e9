"""Data parallel over all 8 devices with LoCo 4-bit gradient all-reduce.

Runs what was measured: benchmarks/lowbit.py's 4-bit default cells (the 919k-parameter default model,
bytes of Shakespeare, 16 x 64 tokens per step, 480 steps, inner AdamW lr 3e-3) with loco.compress's
measured 4-bit default (Lloyd-Max levels on Hadamard-rotated blocks, error feedback, 8-bit error
buffers). Paired with the exact fp32 all-reduce on the same seed and data order (--set loco.bits=None),
its final eval loss was +0.10, +1.29 and +0.20 % on seeds 1-3 (mean +0.53 %), at 0.129 of the fp32
all-reduce's bytes. Reproduce: python benchmarks/lowbit.py --cell default4_s1 (and fp32_s1, ..._s3);
docs/results.md, "Low-bit quality: what the measurements show". For a 3,000-step run, configs/ddp.py's rate (2e-3) is data
parallel's tuned one.

Settings:
    steps=480 batch_size=16 seq_len=64 eval_every=48 eval_batches=16 log_every=8 checkpoint_every=240
    mesh.replicas=1 diloco.enabled=false loco.bits=4 loco.preset=measured optim.lr=0.003
"""

from loco_jax.training.run.config import Config


def get_config() -> Config:
    cfg = Config(steps=480, batch_size=16, seq_len=64, eval_every=48, eval_batches=16, log_every=8,
                 checkpoint_every=240)
    cfg.optim.lr = 3e-3
    cfg.loco.bits = 4
    return cfg
