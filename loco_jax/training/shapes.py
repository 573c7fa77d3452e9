"""The LLaMA-style decoder's dimensions and parameter tree: the one model description the config, the Flax
model (:mod:`loco_jax.training.model`) and the benchmarks' shape-only trees share.

The library knows nothing of LLaMA: :mod:`loco_jax.fragments` finds blocks by their paths in any tree.
"""

from __future__ import annotations

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
