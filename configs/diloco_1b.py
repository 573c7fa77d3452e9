"""The Streaming DiLoCo paper's 1B recipe, for GPU pods (run the same command on every host).

24 blocks, d_model 2048, 16 heads, SwiGLU 5632, vocabulary 32k (SentencePiece), sequence 2048;
H = 100 inner steps, 9 fragments, overlap 1, alpha 0.5, 4-bit (e3m0) outer exchange; inner AdamW
lr 4e-4 (betas 0.9 / 0.95, weight decay 0.1) with warm-up and cosine decay; outer SGD lr 0.4 with
Nesterov momentum 0.9. Set mesh.replicas to the number of clusters (one replica per host group) and
batch_size to the global batch in sequences.

Settings:
    steps=88000 batch_size=512 seq_len=2048 model.d_model=2048 model.num_layers=24 model.num_heads=16
    model.d_ff=5632 model.vocab_size=32000 optim.lr=0.0004 optim.b1=0.9 optim.b2=0.95 optim.weight_decay=0.1
    diloco.sync_every=100 diloco.num_fragments=9 diloco.overlap=1 diloco.alpha=0.5 diloco.bits=4
    diloco.format=e3m0 diloco.outer_lr=0.4 diloco.outer_momentum=0.9 micro_batch=8

Memory: each device runs its share of the batch in micro-batches of 8 sequences (micro_batch: the
accumulation count follows from the device count, 8 on 2 replicas x 4 GPUs, 1 from 64 GPUs up), blocks
rematerialised, bf16 compute. On 2 x 4 H200s the GPU compiler plans 54.4-55.5 GiB per device (25.4 GiB of
state: fp32 parameters, AdamW moments, DiLoCo's global parameters and outer momentum; the rest
temporaries); without micro-batches it needed 277 GiB. `python benchmarks/memory.py --config
configs/diloco_1b.py --devices 4 --layout replicated --compiler gpu` (docs/results.md).

It trains on your corpus, never on the Shakespeare demo text: without data.path it refuses to start
(data.require_path) and prints the command below. Tokenize once, then run the same command on every host:

    python prepare_data.py --input /path/to/corpus --output /data/shards --tokenizer sentencepiece \\
        --vocab-size 32000
    python train.py --config configs/diloco_1b.py --workdir /ckpt/run1 \\
        --set data.path=/data/shards --set data.sp_model=/data/shards/tokenizer.model \\
        --coordinator HOST0:1234 --num-processes N --process-id I
"""

from loco_jax.training.run.config import Config


def get_config() -> Config:
    cfg = Config(steps=88_000, batch_size=512, seq_len=2048, eval_every=1000, eval_batches=16,
                 log_every=10, checkpoint_every=1000, keep_checkpoints=3, micro_batch=8)
    m = cfg.model
    m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.d_ff = 32_000, 2048, 24, 16, 5632
    m.max_seq_len, m.scan_layers, m.remat, m.compute_dtype = 2048, False, True, "bfloat16"
    cfg.data.tokenizer, cfg.data.sp_vocab_size = "sentencepiece", 32_000
    cfg.data.require_path = True  # a real corpus (prepare_data.py); checked when the data loads, not on compile
    o = cfg.optim
    o.lr, o.warmup_steps, o.min_lr_ratio, o.b1, o.b2, o.weight_decay, o.grad_clip = 4e-4, 1000, 0.1, 0.9, 0.95, 0.1, 1.0
    cfg.mesh.replicas = 2
    cfg.loco.bits = None  # exact all-reduce inside a cluster; set 4 to compress it too
    d = cfg.diloco
    d.enabled, d.sync_every, d.num_fragments, d.overlap, d.alpha = True, 100, 9, 1, 0.5
    d.bits, d.format, d.outer_lr, d.outer_momentum = 4, "e3m0", 0.4, 0.9
    return cfg
