"""The LLaMA-style decoder's dimensions and parameter tree: the one model description the config, the Flax
model (:mod:`loco_jax.training.model`) and the benchmarks' shape-only trees share.

The library knows nothing of LLaMA: :mod:`loco_jax.fragments` finds blocks by their paths in any tree.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from loco_jax.checks import is_int, require_int

DIMS = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff")


def check_dims(*, num_layers, d_model, num_heads, num_kv_heads=None, d_ff, vocab_size, prefix: str = "") -> int:
    """Refuses dimensions no decoder has, naming the field (``prefix`` before it, e.g. ``"ModelConfig."``);
    returns the key/value head count (``num_kv_heads``, or ``num_heads`` when None)."""
    for name, v in dict(vocab_size=vocab_size, d_model=d_model, num_layers=num_layers, num_heads=num_heads,
                        d_ff=d_ff).items():
        require_int(f"{prefix}{name}", v, "a positive int")
    if d_model % num_heads:
        raise ValueError(f"d_model={d_model} must be divisible by num_heads={num_heads}.")
    kv = num_heads if num_kv_heads is None else num_kv_heads
    if not is_int(kv) or kv < 1 or num_heads % kv:
        raise ValueError(f"num_kv_heads={num_kv_heads!r} must be a positive divisor of num_heads={num_heads}.")
    return kv


# The paper's 1B model. SwiGLU hidden size d_ff = round_up(8/3 * d_model, 256)
# = round_up(5461.33, 256) = 5632. Parameters (untied head): 1,364,297,728 =
#   embed 65,536,000 + lm_head 65,536,000 + final_norm 2,048
#   + 24 blocks x 51,384,320 (attention 4 x 2048^2 = 16,777,216; MLP
#     3 x 2048 x 5632 = 34,603,008; two norms 4,096).
LLAMA_1B = dict(num_layers=24, d_model=2048, num_heads=16, d_ff=5632, vocab_size=32000)
LLAMA_1B_NUM_PARAMS = 1_364_297_728


def transformer_shapes(
    *,
    num_layers: int = 24,
    d_model: int = 2048,
    num_heads: int = 16,
    num_kv_heads: int | None = None,
    d_ff: int = 5632,
    vocab_size: int = 32000,
    tie_embeddings: bool = False,
    scan_layers: bool = False,
    dtype=jnp.float32,
) -> dict:
    """The LLaMA-style decoder's parameter tree as ``jax.ShapeDtypeStruct`` (the application's one definition).

    ``head_dim = d_model // num_heads``, ``kv = num_kv_heads or num_heads``::

        {"embed": {"embedding": (vocab, d)},
         "layers": {0: BLOCK, ..., L-1: BLOCK},   # scan_layers=True: BLOCK with a leading (L,) axis
         "final_norm": {"scale": (d,)},
         "lm_head": {"kernel": (d, vocab)}}       # absent when tie_embeddings
        BLOCK = {"attn_norm": {"scale": (d,)},
                 "attn": {"wq": {"kernel": (d, heads*hd)}, "wk": {"kernel": (d, kv*hd)},
                          "wv": {"kernel": (d, kv*hd)}, "wo": {"kernel": (heads*hd, d)}},
                 "mlp_norm": {"scale": (d,)},
                 "mlp": {"w_gate": {"kernel": (d, d_ff)}, "w_up": {"kernel": (d, d_ff)},
                         "w_down": {"kernel": (d_ff, d)}}}

    With the defaults (``LLAMA_1B``) it has 1,364,297,728 parameters.
    """
    kv = check_dims(num_layers=num_layers, d_model=d_model, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    d_ff=d_ff, vocab_size=vocab_size)
    hd = d_model // num_heads
    lead = (num_layers,) if scan_layers else ()

    def s(*shape, stacked=False):
        return jax.ShapeDtypeStruct((lead + shape) if stacked else shape, dtype)

    def block(stacked):
        return {
            "attn_norm": {"scale": s(d_model, stacked=stacked)},
            "attn": {
                "wq": {"kernel": s(d_model, num_heads * hd, stacked=stacked)},
                "wk": {"kernel": s(d_model, kv * hd, stacked=stacked)},
                "wv": {"kernel": s(d_model, kv * hd, stacked=stacked)},
                "wo": {"kernel": s(num_heads * hd, d_model, stacked=stacked)},
            },
            "mlp_norm": {"scale": s(d_model, stacked=stacked)},
            "mlp": {
                "w_gate": {"kernel": s(d_model, d_ff, stacked=stacked)},
                "w_up": {"kernel": s(d_model, d_ff, stacked=stacked)},
                "w_down": {"kernel": s(d_ff, d_model, stacked=stacked)},
            },
        }

    tree = {
        "embed": {"embedding": s(vocab_size, d_model)},
        "layers": block(True) if scan_layers else {i: block(False) for i in range(num_layers)},
        "final_norm": {"scale": s(d_model)},
    }
    if not tie_embeddings:
        tree["lm_head"] = {"kernel": s(d_model, vocab_size)}
    return tree


def llama_1b_shapes(scan_layers: bool = False) -> dict:
    """The paper's 1B model (24 blocks, d=2048, 16 heads, d_ff=5632, vocab 32000): 1,364,297,728 parameters."""
    return transformer_shapes(**LLAMA_1B, scan_layers=scan_layers)


_COMPUTE_DTYPES = ("bfloat16", "float32", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Sizes and policies of the transformer. Frozen and hashable (usable as a static jit argument).

    Attributes:
      vocab_size: ``V``.
      d_model: ``d``.
      num_layers: ``L``.
      num_heads: ``H`` query heads; ``head_dim = d_model // num_heads`` (even, for RoPE).
      num_kv_heads: key/value heads (``None``: ``num_heads``); a divisor of
        ``num_heads`` (grouped-query attention when smaller).
      d_ff: SwiGLU hidden size.
      max_seq_len: longest sequence ``apply`` accepts.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon (1e-5, as LLaMA 2 / TinyLlama).
      tie_embeddings: ``logits = x @ embedding.T`` and no ``lm_head``.
      scan_layers: one stacked block (leaves ``(L, ...)``) run by ``jax.lax.scan``.
      remat: rematerialise every block in the backward pass (``jax.checkpoint``).
      compute_dtype: activations and matmuls ("bfloat16", "float32" or "float16").
      param_dtype: stored parameters ("float32").
      init_std: std of the normal init; ``wo``/``w_down`` use ``init_std / sqrt(2 L)``.
      attention_impl: ``implementation=`` of ``jax.nn.dot_product_attention``
        (``None``: XLA; ``"cudnn"`` for flash attention on GPU).
    """

    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    d_ff: int = 0
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    scan_layers: bool = False
    remat: bool = False
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    init_std: float = 0.02
    attention_impl: str | None = None

    def __post_init__(self):
        check_dims(**{name: getattr(self, name) for name in (*DIMS, "num_kv_heads")},
                          prefix="ModelConfig.")
        require_int("ModelConfig.max_seq_len", self.max_seq_len, "a positive int")
        if self.head_dim % 2:
            raise ValueError(f"head_dim = d_model / num_heads = {self.head_dim} must be even for RoPE.")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r}; choose one of {_COMPUTE_DTYPES}.")
        if not jnp.issubdtype(jnp.dtype(self.param_dtype), jnp.floating):
            raise ValueError(f"param_dtype={self.param_dtype!r} must be a floating dtype.")
        if not (self.norm_eps > 0 and self.rope_theta > 0 and self.init_std > 0):
            raise ValueError("norm_eps, rope_theta and init_std must be positive.")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_heads if self.num_kv_heads is None else self.num_kv_heads

    @property
    def cdtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def pdtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **kwargs) -> ModelConfig:
        return dataclasses.replace(self, **kwargs)

    def shapes(self) -> dict:
        """The parameter tree as ``jax.ShapeDtypeStruct``: :func:`transformer_shapes`."""
        return transformer_shapes(
            num_layers=self.num_layers,
            d_model=self.d_model,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            d_ff=self.d_ff,
            vocab_size=self.vocab_size,
            tie_embeddings=self.tie_embeddings,
            scan_layers=self.scan_layers,
            dtype=self.pdtype,
        )
