"""A LLaMA-style decoder-only transformer in Flax NNX, with a pure functional API.

The maths
---------
Tokens ``t`` of shape ``(B, T)`` (int32) become logits ``(B, T, V)`` (fp32)::

    x_0    = E[t]                                        # embedding lookup, E: (V, d)
    for each block l = 0 .. L-1:
        a      = x + Attn(RMSNorm_attn(x))
        x      = a + MLP(RMSNorm_mlp(a))
    logits = RMSNorm_final(x) @ W_head                   # W_head: (d, V); tied: E^T

RMSNorm (no mean subtraction, no bias; ``g`` is the ``scale`` parameter, init 1)::

    RMSNorm(x) = x / sqrt(mean_i(x_i^2) + eps) * g        # computed in fp32

Attention with ``H`` query heads, ``KV`` key/value heads (grouped-query attention
when ``KV < H``: query head ``h`` uses key/value head ``h // (H / KV)``) and
head size ``hd = d / H``::

    q = x Wq -> (B, T, H, hd),  k = x Wk -> (B, T, KV, hd),  v = x Wv -> (B, T, KV, hd)
    q, k = RoPE(q), RoPE(k)
    o_h  = softmax(q_h k_{g(h)}^T / sqrt(hd) + causal mask) v_{g(h)}
    Attn = concat_h(o_h) Wo                               # Wo: (H*hd, d)

computed by ``jax.nn.dot_product_attention(q, k, v, is_causal=True)``, which
handles GQA natively (logits and softmax in fp32).

Rotary position embeddings, "rotate-half" / split-halves convention (GPT-NeoX,
Hugging Face LLaMA): the head vector is split into halves ``x1 = x[:hd/2]``,
``x2 = x[hd/2:]``; pair ``(x1[i], x2[i])`` is rotated by the angle
``p * theta^(-2i/hd)`` at position ``p = 0 .. T-1``::

    RoPE(x) = concat(x1 cos - x2 sin,  x2 cos + x1 sin)   # computed in fp32

(the interleaved convention of the original LLaMA code pairs ``(x[2i], x[2i+1])``
instead; the two differ by a fixed permutation of the wq/wk columns).

SwiGLU MLP::

    MLP(x) = W_down( silu(x W_gate) * (x W_up) ),   silu(z) = z * sigmoid(z)

The parameter tree
------------------
``nnx.split(model, nnx.Param)`` → ``nnx.to_pure_dict`` gives exactly
:func:`loco_jax.training.shapes.transformer_shapes` (the application's one definition)::

    embed/embedding, layers/<i>/{attn_norm, attn/{wq,wk,wv,wo}, mlp_norm, mlp/{w_gate,w_up,w_down}},
    final_norm/scale, lm_head/kernel (absent with tie_embeddings)

(shapes in that function's docstring). Unrolled layers live in an ``nnx.List`` (pure-dict keys are the ints
``0 .. L-1``). Scanned layers are one ``Block`` built under ``nnx.vmap`` (every
leaf stacked on a leading ``(L,)`` axis) and run with ``jax.lax.scan`` over its
split state. Layer ``i`` is initialised from the same key in both layouts, so
``init_params`` with ``scan_layers=True`` is exactly the stacked unrolled init.

Initialisation: every kernel and the embedding ~ N(0, init_std^2) (0.02), the
residual-branch output projections ``wo`` and ``w_down`` ~ N(0, (init_std /
sqrt(2 L))^2) (GPT-2 / Megatron scaling); norm scales 1.

Dtype policy
------------
Parameters are stored in ``param_dtype`` (fp32). The forward pass casts them to
``compute_dtype`` (bf16 by default, "float32" for exact tests) at use: the
embedding output, the residual stream and every matmul are in
``compute_dtype``; RMSNorm, RoPE and the attention softmax are computed in fp32
and cast back; the output head accumulates in fp32
(``preferred_element_type``) and the logits are returned in fp32; the loss is
an fp32 log-softmax. Gradients come out in the parameter dtype (fp32).

The pure functional API (what a trainer calls inside ``shard_map``;
no NNX object is needed at step time): :func:`init_params`, :func:`apply`,
:func:`loss_fn`, :func:`count_params`, :func:`abstract_params`. ``apply`` merges
a cached graphdef with the pure dict (``nnx.merge``), so it runs exactly the
code of :class:`Transformer`. :func:`generate` continues prompts token by token
(greedy, or temperature / top-k sampling) by re-running ``apply`` over a fixed
window.

Why one module of this size: the Flax model, its loss and ``generate`` use the same blocks and
attention; the parameter tree's shapes are :mod:`loco_jax.training.shapes`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from loco_jax import fragments
from loco_jax.checks import require_int
from loco_jax.training import shapes
from loco_jax.training.shapes import ModelConfig

__all__ = [
    "CONFIGS",
    "MLP",
    "Attention",
    "Block",
    "ModelConfig",
    "RMSNorm",
    "Transformer",
    "abstract_params",
    "apply",
    "apply_rope",
    "count_params",
    "from_params",
    "generate",
    "init_params",
    "loss_fn",
    "params_of",
    "rope_tables",
    "swiglu_hidden",
]

def _round_up(x: float, m: int) -> int:
    return int(math.ceil(x / m) * m)


def swiglu_hidden(d_model: int, multiple_of: int = 256) -> int:
    """LLaMA's SwiGLU size: ``round_up(8/3 * d_model, multiple_of)`` (2048 -> 5632)."""
    return _round_up(8 * d_model / 3, multiple_of)


# ---------------------------------------------------------------------------
# Pieces
# ---------------------------------------------------------------------------


def rope_tables(seq_len: int, head_dim: int, theta: float):
    """``cos, sin`` of shape ``(seq_len, head_dim // 2)`` (fp32): angle ``p * theta^(-2i/hd)``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim))
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on ``x`` of shape ``(B, T, heads, hd)``; computed in fp32, returned in ``x.dtype``."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, hd/2), broadcast over batch and heads
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)


class RMSNorm(nnx.Module):
    """``x / sqrt(mean(x^2) + eps) * scale`` in fp32, returned in ``dtype``."""

    def __init__(self, features: int, *, eps: float, dtype, param_dtype):
        self.scale = nnx.Param(jnp.ones((features,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x):
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def _linear(cfg: ModelConfig, n_in: int, n_out: int, std: float, rngs: nnx.Rngs, **kw) -> nnx.Linear:
    return nnx.Linear(
        n_in,
        n_out,
        use_bias=False,
        dtype=cfg.cdtype,
        param_dtype=cfg.pdtype,
        kernel_init=nnx.initializers.normal(std),
        rngs=rngs,
        **kw,
    )


def _out_std(cfg: ModelConfig) -> float:
    return cfg.init_std / math.sqrt(2 * cfg.num_layers)


class Attention(nnx.Module):
    """Causal multi-head / grouped-query attention with RoPE."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, H, KV, hd = cfg.d_model, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.wq = _linear(cfg, d, H * hd, cfg.init_std, rngs)
        self.wk = _linear(cfg, d, KV * hd, cfg.init_std, rngs)
        self.wv = _linear(cfg, d, KV * hd, cfg.init_std, rngs)
        self.wo = _linear(cfg, H * hd, d, _out_std(cfg), rngs)
        self.num_heads, self.kv_heads, self.head_dim = H, KV, hd
        self.impl = cfg.attention_impl

    def __call__(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.wq(x).reshape(B, T, self.num_heads, self.head_dim)
        k = self.wk(x).reshape(B, T, self.kv_heads, self.head_dim)
        v = self.wv(x).reshape(B, T, self.kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.impl)
        return self.wo(o.reshape(B, T, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: ``w_down(silu(w_gate x) * w_up x)``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.w_gate = _linear(cfg, cfg.d_model, cfg.d_ff, cfg.init_std, rngs)
        self.w_up = _linear(cfg, cfg.d_model, cfg.d_ff, cfg.init_std, rngs)
        self.w_down = _linear(cfg, cfg.d_ff, cfg.d_model, _out_std(cfg), rngs)

    def __call__(self, x):
        return self.w_down(jax.nn.silu(self.w_gate(x)) * self.w_up(x))


class Block(nnx.Module):
    """Pre-norm residual block: ``a = x + attn(attn_norm(x)); a + mlp(mlp_norm(a))``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, cfg.d_model, eps=cfg.norm_eps, dtype=cfg.cdtype, param_dtype=cfg.pdtype)
        self.attn_norm = norm()
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = norm()
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
    """The decoder: ``tokens (B, T) int32 -> logits (B, T, V) fp32``.

    Layer ``i`` is initialised from ``split(k_layers, L)[i]`` with ``k_embed,
    k_layers, k_head = split(rngs.params(), 3)``, in both layouts.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        cfg = self.config = config
        k_embed, k_layers, k_head = jax.random.split(rngs.params(), 3)
        layer_keys = jax.random.split(k_layers, cfg.num_layers)
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.cdtype,
            param_dtype=cfg.pdtype,
            embedding_init=nnx.initializers.normal(cfg.init_std),
            rngs=nnx.Rngs(params=k_embed),
        )
        if cfg.scan_layers:
            make = nnx.vmap(lambda k: Block(cfg, rngs=nnx.Rngs(params=k)), in_axes=0, out_axes=0)
            self.layers = make(layer_keys)
        else:
            self.layers = nnx.List([Block(cfg, rngs=nnx.Rngs(params=k)) for k in layer_keys])
        self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, dtype=cfg.cdtype, param_dtype=cfg.pdtype)
        if not cfg.tie_embeddings:
            self.lm_head = _linear(
                cfg, cfg.d_model, cfg.vocab_size, cfg.init_std, nnx.Rngs(params=k_head),
                preferred_element_type=jnp.float32,
            )

    def __call__(self, tokens, layer_fn=None, layer_extra=None, stack_fn=None):
        """``layer_fn(layer_params, extra)`` (scanned layers only) maps each layer's pure parameter dict
        inside the scan before the layer runs; ``layer_extra`` is scanned beside the layers (FSDP gathers
        each layer's shards there, ``loco_jax.training.run.steps``). ``stack_fn(layer, x, stack, consts)``
        (scanned layers only) replaces the scan itself: ``layer(layer_params, h, *consts)`` is one block
        (closing over no traced value), ``stack`` the stacked pure parameter dict; it returns the stack's
        output (``loco_jax.backward.stack`` runs LoCo's exchange in its backward pass)."""
        cfg = self.config
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tokens.shape}.")
        T = tokens.shape[1]
        if T > cfg.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={cfg.max_seq_len}.")
        cos, sin = rope_tables(T, cfg.head_dim, cfg.rope_theta)
        x = self.embed(tokens).astype(cfg.cdtype)

        if cfg.scan_layers and stack_fn is not None:
            graphdef, state = nnx.split(self.layers)

            def layer(layer_params, h, cos, sin):
                return nnx.merge(graphdef, layer_params)(h, cos, sin)

            x = stack_fn(layer, x, nnx.to_pure_dict(state), (cos, sin))
        elif cfg.scan_layers:
            graphdef, state = nnx.split(self.layers)

            def body(h, item):
                layer_state, extra = item
                if layer_fn is not None:
                    layer_state = layer_fn(nnx.to_pure_dict(layer_state), extra)
                return nnx.merge(graphdef, layer_state)(h, cos, sin), None

            if cfg.remat:
                body = jax.checkpoint(body, prevent_cse=False)
            x, _ = jax.lax.scan(body, x, (state, layer_extra))
        else:
            if layer_fn is not None or stack_fn is not None:
                raise ValueError("layer_fn and stack_fn map the layers of a scanned stack; this model has "
                                 "scan_layers=False.")
            for block in self.layers:
                if cfg.remat:
                    graphdef, state = nnx.split(block)
                    x = jax.checkpoint(lambda s, h, g=graphdef: nnx.merge(g, s)(h, cos, sin))(state, x)
                else:
                    x = block(x, cos, sin)

        x = self.final_norm(x)
        if cfg.tie_embeddings:
            emb = self.embed.embedding[...].astype(cfg.cdtype)
            return jnp.einsum("btd,vd->btv", x, emb, preferred_element_type=jnp.float32)
        return self.lm_head(x).astype(jnp.float32)


# ---------------------------------------------------------------------------
# The pure functional API
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _graphdef(config: ModelConfig):
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract, nnx.Param)
    return graphdef


def params_of(model: Transformer) -> dict:
    """The pure nested dict of a model's ``nnx.Param`` arrays (the fragments tree)."""
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def from_params(config: ModelConfig, params) -> Transformer:
    """A :class:`Transformer` holding ``params`` (a pure dict; arrays are not copied)."""
    return nnx.merge(_graphdef(config), params)


def init_params(config: ModelConfig, key) -> dict:
    """Fresh parameters as a pure nested dict of ``param_dtype`` arrays (the fragments tree)."""
    return params_of(Transformer(config, rngs=nnx.Rngs(params=key)))


def abstract_params(config: ModelConfig) -> dict:
    """The parameter dict as ``jax.ShapeDtypeStruct``, built by ``nnx.eval_shape`` (nothing is allocated)."""
    return params_of(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))


def apply(config: ModelConfig, params, tokens, *, layer_fn=None, layer_extra=None, stack_fn=None):
    """``tokens`` int32 ``(B, T)`` -> fp32 logits ``(B, T, V)``; runs :class:`Transformer` via ``nnx.merge``.

    ``layer_fn``, ``layer_extra``: see :meth:`Transformer.__call__` (``params["layers"]`` may then hold
    what ``layer_fn`` turns into each layer's parameters, e.g. FSDP shards).
    """
    return from_params(config, params)(jnp.asarray(tokens), layer_fn=layer_fn, layer_extra=layer_extra,
                                       stack_fn=stack_fn)


def loss_fn(config: ModelConfig, params, tokens, targets, mask=None, *, layer_fn=None, layer_extra=None,
            stack_fn=None):
    """Mean next-token cross-entropy (fp32): ``targets[b, t]`` is the label of position ``t``.

    ``mask`` (same shape as ``targets``, bool or 0/1) weights positions; the mean
    is over the masked-in positions (0 when none are).
    """
    logits = apply(config, params, tokens, layer_fn=layer_fn, layer_extra=layer_extra, stack_fn=stack_fn)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    if mask is None:
        return jnp.mean(ce)
    m = jnp.asarray(mask, jnp.float32)
    return jnp.sum(ce * m) / jnp.maximum(jnp.sum(m), 1.0)


def generate(
    config: ModelConfig, params, prompt, length: int, *, key=None, temperature: float = 0.0,
    top_k: int | None = None, prompt_lengths=None, window: int | None = None, vocab_size: int | None = None,
):
    """Continues each row of ``prompt`` by ``length`` tokens: int32 ``(B, length)``, the new tokens only.

    Each step runs the whole forward pass (:func:`apply`) over a fixed buffer of ``W = min(window,
    P + length)`` tokens and picks the next token from the logits at the row's last filled position;
    a ``lax.fori_loop`` over the steps makes one compiled program (no KV cache: simple, and cheap for
    the small models this is meant for: ``length`` forward passes over ``W`` positions). Because
    attention is causal, the unfilled tail of the buffer never influences the logits that are read,
    so rows of different lengths share one buffer.

    **Sliding window**: when a row's context reaches ``W`` tokens, its oldest token is dropped (the
    buffer shifts left by one) and generation goes on; the model always sees the last ``W`` tokens
    and never more than ``max_seq_len``. RoPE is relative, so the shift changes nothing but what is
    in the window. Pass ``window=seq_len`` of the training run to stay at context lengths it saw.

    Args:
      config: the model's :class:`ModelConfig` (static).
      params: the pure parameter dict. Put it on **one device** (a replicated multi-device array
        would run the loop on every device of its sharding, and across processes on all of them).
      prompt: int ``(B, P)`` token ids, ``1 <= P <= window``; rows shorter than ``P`` are
        right-padded (any id) and give their lengths in ``prompt_lengths``.
      length: tokens to generate per row (static; ``0`` gives a ``(B, 0)`` array).
      key: a PRNG key; needed when ``temperature > 0``. Step ``i`` draws with ``fold_in(key, i)``,
        so a given key, prompt and parameter set always give the same tokens.
      temperature: ``0`` is greedy (``argmax``, ties to the lowest id, as ``np.argmax``); ``> 0``
        samples from ``softmax(logits / temperature)``.
      top_k: sample only among the ``top_k`` largest logits (ties at the ``k``-th value are kept);
        ``None`` samples from the whole vocabulary. Ignored when greedy.
      prompt_lengths: int ``(B,)``, each in ``[1, P]``; ``None``: every row is ``P`` tokens long.
      window: the context the model sees, ``<= max_seq_len`` (``None``: ``max_seq_len``).
      vocab_size: only ids below it are produced (a tokenizer smaller than the model's
        vocabulary); ``None``: ``config.vocab_size``.

    Raises:
      ValueError: for a prompt that is not 2-D integer ids, empty or longer than the window, a negative length,
        bad ``temperature``/``top_k``/``window``/``vocab_size``/``prompt_lengths``, or sampling
        without a key.
    """
    shape = tuple(np.shape(prompt))
    if len(shape) != 2:
        raise ValueError(f"prompt must be (batch, prompt_len) token ids, got shape {shape}.")
    B, P = shape
    dtype = prompt.dtype if hasattr(prompt, "dtype") else np.asarray(prompt).dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"prompt must hold integer token ids, got dtype {dtype}.")
    window = config.max_seq_len if window is None else int(window)
    if not 1 <= window <= config.max_seq_len:
        raise ValueError(f"window={window} must lie in [1, max_seq_len={config.max_seq_len}].")
    if not 1 <= P <= window:
        raise ValueError(f"prompt length {P} must lie in [1, window={window}]; trim the prompt to its last "
                         f"{window} tokens.")
    require_int("length", length, "a non-negative int", minimum=0)
    vocab = config.vocab_size if vocab_size is None else int(vocab_size)
    if not 1 <= vocab <= config.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, model vocab_size={config.vocab_size}].")
    temperature = float(temperature)
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature={temperature} must be a finite number >= 0 (0: greedy).")
    greedy = temperature == 0
    if not greedy and key is None:
        raise ValueError("sampling with temperature > 0 needs a PRNG key (key=jax.random.key(seed)).")
    if top_k is not None and (isinstance(top_k, bool) or not 1 <= int(top_k) <= vocab):
        raise ValueError(f"top_k={top_k!r} must be None or an int in [1, {vocab}].")
    if prompt_lengths is None:
        prompt_lengths = np.full((B,), P, np.int32)
    elif not isinstance(prompt_lengths, jax.core.Tracer):
        lengths = np.asarray(prompt_lengths)
        if lengths.shape != (B,) or lengths.min(initial=1) < 1 or lengths.max(initial=1) > P:
            raise ValueError(f"prompt_lengths must be {B} ints in [1, {P}], got {lengths.tolist()}.")
    if length == 0:
        return jnp.zeros((B, 0), jnp.int32)
    if key is None:
        key = jax.random.key(0)  # unused when greedy; keeps one signature for the compiled program
    return _generate(
        config, params, jnp.asarray(prompt, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32), key,
        jnp.float32(temperature if not greedy else 1.0), length=int(length), window=min(window, P + int(length)),
        greedy=greedy, top_k=None if top_k is None else int(top_k), vocab_size=vocab,
    )


def _next_token(logits, key, temperature, *, greedy: bool, top_k: int | None, vocab_size: int):
    """Next ids (int32 ``(B,)``) from last-position logits ``(B, V)`` (fp32)."""
    if vocab_size < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "length", "window", "greedy", "top_k", "vocab_size"))
def _generate(config, params, prompt, prompt_lengths, key, temperature, *, length, window, greedy, top_k,
              vocab_size):
    B, P = prompt.shape
    rows = jnp.arange(B)
    buf = jnp.zeros((B, window), jnp.int32).at[:, :P].set(prompt)

    def step(i, carry):
        buf, n, out = carry  # n: filled positions of each row, in [1, window]
        logits = apply(config, params, buf)  # (B, window, V); positions >= n do not reach position n - 1
        last = jnp.take_along_axis(logits, (n - 1)[:, None, None], axis=1)[:, 0]
        tok = _next_token(last, jax.random.fold_in(key, i), temperature, greedy=greedy, top_k=top_k,
                          vocab_size=vocab_size)
        full = n == window
        buf = jnp.where(full[:, None], jnp.roll(buf, -1, axis=1), buf)  # slide: drop the oldest token
        buf = buf.at[rows, jnp.minimum(n, window - 1)].set(tok)
        return buf, jnp.minimum(n + 1, window), out.at[:, i].set(tok)

    out = jnp.zeros((B, length), jnp.int32)
    _, _, out = jax.lax.fori_loop(0, length, step, (buf, prompt_lengths, out))
    return out


def count_params(config: ModelConfig) -> int:
    """Number of parameters (from the shapes; nothing is allocated)."""
    return fragments.count_params(config.shapes())


# ---------------------------------------------------------------------------
# Named configurations
# ---------------------------------------------------------------------------

CONFIGS: dict[str, ModelConfig] = {
    # byte-level (vocab 256) models for CPU tests and demos
    "tiny": ModelConfig(vocab_size=256, d_model=128, num_layers=2, num_heads=4, d_ff=384, max_seq_len=128),
    "small": ModelConfig(
        vocab_size=256, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4, d_ff=768, max_seq_len=256
    ),
    # GPT-3-small sizes with the LLaMA tokenizer's vocabulary, untied head
    "125m": ModelConfig(vocab_size=32000, d_model=768, num_layers=12, num_heads=12, d_ff=2048, max_seq_len=1024),
    # the paper's 1B model (shapes.LLAMA_1B): 1,364,297,728 parameters
    "1b": ModelConfig(**shapes.LLAMA_1B, max_seq_len=2048),
}
