"""An 8B recipe that fits an H200: LLaMA-3-8B-like shapes, FSDP inside each replica, Streaming DiLoCo across.

Model: 32 blocks, d_model 4096, 32 heads with 8 KV heads (grouped-query attention), SwiGLU 14336,
vocabulary 128,256, sequence 4096, scanned and rematerialised blocks, bf16 compute (fp32 parameters).

Inside a replica (one host of 8 GPUs): FSDP over its 8 devices (mesh.fsdp): parameters, AdamW moments
and DiLoCo's global parameters and outer momentum are cut 1/8 per device; each step gathers the
parameters in bf16 and reduce-scatters the gradient through LoCo at 4 bits (Lloyd-Max levels on
rotated blocks, plain error feedback, 8-bit error buffers: the full-size buffer that stays per device),
exchanged inside the backward pass (loco.in_backward: one bucket per block, each block's all-to-all under
the backward compute of the block below it; 94.7 % of a micro-batch's backward gemm FLOPs under LoCo's
exchange on 8 H200s by the GPU compiler's schedule, none before; docs/results.md, issue 28).
Across replicas (mesh.replicas, one per cluster): Streaming DiLoCo with the paper's settings scaled to
32 blocks: H = 100, 12 fragments (fragment 0: embeddings, final norm and head; 11 fragments of 2-3
strided blocks), overlap 1, alpha 0.5, a 4-bit e3m0 outer exchange, outer SGD lr 0.4 with Nesterov
momentum 0.9. On 2 hosts x 8 H200s the GPU compiler runs the whole step's compute under the exchange
(100 % of a send program's gemm FLOPs, with the XLA options the trainer sets; docs/results.md, "The 8B
exchange under the step").

Settings:
    seq_len=4096 accum_steps=8 model.d_model=4096 model.num_layers=32 model.num_heads=32 model.num_kv_heads=8
    model.d_ff=14336 model.vocab_size=128256 mesh.fsdp=true loco.bits=4 loco.format=lloyd loco.rotate=true
    loco.beta=0.0 loco.error_bits=8 loco.in_backward=true diloco.sync_every=100 diloco.num_fragments=12 diloco.overlap=1
    diloco.alpha=0.5 diloco.bits=4 diloco.format=e3m0 diloco.outer_lr=0.4 diloco.outer_momentum=0.9

Every setting that decides memory or bandwidth is pinned here rather than left to the library's
per-bit defaults, so a later change of those defaults does not move this recipe. Per device: one
sequence of 4096 tokens per micro-batch, 8 micro-batches per step (accum_steps): 8 sequences per device
per step, batch_size = 64 x mesh.replicas sequences (256 at 4 replicas: 1M tokens per step).

Memory: `python benchmarks/memory.py --config configs/diloco_8b.py` prints the compiler's per-device
estimate beside the analytic count, for FSDP and for replicated state (docs/results.md, "Memory per
device"). Run it with the device count of one replica; JAX's memory fraction on the GPUs is set with
XLA_PYTHON_CLIENT_MEM_FRACTION (see the README).

    python prepare_data.py --input /path/to/corpus --output /data/shards --tokenizer sentencepiece \\
        --vocab-size 128256
    python train.py --config configs/diloco_8b.py --workdir /ckpt/run8b \\
        --set data.path=/data/shards --set data.sp_model=/data/shards/tokenizer.model \\
        --coordinator HOST0:1234 --num-processes N --process-id I
"""

from loco_jax.training.run.config import Config

REPLICAS = 4


def get_config() -> Config:
    cfg = Config(steps=100_000, batch_size=64 * REPLICAS, seq_len=4096, accum_steps=8, eval_every=1000,
                 eval_batches=8, log_every=10, checkpoint_every=1000, keep_checkpoints=2, sample_tokens=64)
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.num_kv_heads, m.d_ff = 128_256, 4096, 32, 32, 8, 14_336
    m.max_seq_len, m.tie_embeddings = 4096, False
    m.scan_layers, m.remat, m.compute_dtype = True, True, "bfloat16"
    cfg.data.tokenizer, cfg.data.sp_vocab_size = "sentencepiece", 128_256
    cfg.data.require_path = True  # a real corpus (prepare_data.py); checked when the data loads, not on compile
    o = cfg.optim
    o.lr, o.warmup_steps, o.min_lr_ratio, o.b1, o.b2, o.weight_decay, o.grad_clip = 3e-4, 2000, 0.1, 0.9, 0.95, 0.1, 1.0
    cfg.mesh.replicas, cfg.mesh.data, cfg.mesh.fsdp = REPLICAS, None, True  # data: every device of a replica
    c = cfg.loco
    c.bits, c.format, c.rotate, c.beta, c.compensate, c.compensate_second_stage = 4, "lloyd", True, 0.0, True, False
    c.error_bits, c.block_size, c.reset_every, c.bucket_size = 8, 256, 1024, 2**28
    c.in_backward = True
    d = cfg.diloco
    d.enabled, d.sync_every, d.num_fragments, d.overlap, d.alpha = True, 100, 12, 1, 0.5
    d.bits, d.format, d.rotate, d.compensate, d.mode, d.block_size = 4, "e3m0", False, False, "all_gather", 256
    d.outer_lr, d.outer_momentum = 0.4, 0.9
    return cfg
