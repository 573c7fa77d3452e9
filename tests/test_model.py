"""The Flax NNX transformer (loco_jax.model): tree layout, maths, layouts, causality, training, LoCo.

Sizes are tiny and numbers are compared with ``compute_dtype="float32"``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import fragments, hlo, loco, specs
from loco_jax.training import model as M
from loco_jax.training import shapes

# hd = 8, grouped-query attention (2 query heads per kv head), fp32 compute
SMALL = M.ModelConfig(
    vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=32,
    compute_dtype="float32",
)


def _shapes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


def _tokens(shape, vocab, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randint(0, vocab, size=shape), jnp.int32)


# ---------------------------------------------------------------------------
# 1. The parameter tree is shapes.transformer_shapes


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"scan_layers": True},
        {"tie_embeddings": True},
        {"num_kv_heads": 1},
        {"num_kv_heads": 2, "tie_embeddings": True, "scan_layers": True},
    ],
    ids=["unrolled", "scanned", "tied", "gqa", "gqa-tied-scanned"],
)
def test_param_tree_matches_fragments(kwargs):
    cfg = M.CONFIGS["tiny"].replace(num_layers=3, **kwargs)
    expected = shapes.transformer_shapes(
        num_layers=3, d_model=cfg.d_model, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
        d_ff=cfg.d_ff, vocab_size=cfg.vocab_size, tie_embeddings=cfg.tie_embeddings, scan_layers=cfg.scan_layers,
    )
    # the pure dict of nnx.split(model, nnx.Param), as a Flax user gets it
    model = M.Transformer(cfg, rngs=nnx.Rngs(0))
    _, params, rest = nnx.split(model, nnx.Param, ...)
    pure = nnx.to_pure_dict(params)
    assert _shapes(pure) == _shapes(expected)
    assert jax.tree.structure(pure) == jax.tree.structure(expected)  # int keys 0..L-1 when unrolled
    assert not jax.tree.leaves(rest)  # nothing but Params
    assert _shapes(M.init_params(cfg, jax.random.key(1))) == _shapes(expected)
    assert _shapes(M.abstract_params(cfg)) == _shapes(expected)
    assert M.count_params(cfg) == fragments.count_params(expected)
    # and the fragment planner finds the blocks
    plan = fragments.plan(pure, 3)
    assert plan.num_layers == 3 and sum(plan.fragment_sizes()) == M.count_params(cfg)


@pytest.mark.parametrize("scan", [False, True])
def test_1b_tree_is_llama_1b_without_allocating(scan):
    cfg = M.CONFIGS["1b"].replace(scan_layers=scan)
    abstract = M.abstract_params(cfg)  # nnx.eval_shape: ShapeDtypeStructs only
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert _shapes(abstract) == _shapes(shapes.llama_1b_shapes(scan_layers=scan))
    assert jax.tree.structure(abstract) == jax.tree.structure(shapes.llama_1b_shapes(scan_layers=scan))
    assert M.count_params(cfg) == shapes.LLAMA_1B_NUM_PARAMS == 1_364_297_728


def test_named_configs():
    assert M.count_params(M.CONFIGS["1b"]) == shapes.LLAMA_1B_NUM_PARAMS
    assert M.CONFIGS["1b"].max_seq_len == 2048 and M.CONFIGS["1b"].d_ff == M.swiglu_hidden(2048) == 5632
    assert M.CONFIGS["tiny"].vocab_size == 256
    for name, cfg in M.CONFIGS.items():
        assert _shapes(M.abstract_params(cfg)) == _shapes(cfg.shapes()), name
        assert cfg.d_ff >= 8 * cfg.d_model // 3 and cfg.d_model % cfg.num_heads == 0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_heads": 5}, "divisible"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"d_model": 12, "num_heads": 4}, "even"),
        ({"compute_dtype": "int8"}, "compute_dtype"),
        ({"d_ff": 0}, "d_ff"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SMALL.replace(**kwargs)


# ---------------------------------------------------------------------------
# 2. The maths: a NumPy reference forward pass


def _np_forward(cfg, params, tokens):
    """float64 NumPy: embedding, RMSNorm, rotate-half RoPE, causal GQA softmax attention, SwiGLU, head."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    tokens = np.asarray(tokens)
    B, T = tokens.shape
    H, KV, hd = cfg.num_heads, cfg.kv_heads, cfg.d_model // cfg.num_heads
    half = hd // 2
    inv_freq = cfg.rope_theta ** (-np.arange(half) * 2.0 / hd)
    ang = np.arange(T)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang)[None, :, None, :], np.sin(ang)[None, :, None, :]

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + cfg.norm_eps) * g

    def rope(x):  # (B, T, heads, hd): pairs (x[i], x[i + hd/2])
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    x = p["embed"]["embedding"][tokens]
    causal = np.tril(np.ones((T, T), bool))
    for i in range(cfg.num_layers):
        b = p["layers"][i]
        h = rms(x, b["attn_norm"]["scale"])
        q = rope((h @ b["attn"]["wq"]["kernel"]).reshape(B, T, H, hd))
        k = rope((h @ b["attn"]["wk"]["kernel"]).reshape(B, T, KV, hd))
        v = (h @ b["attn"]["wv"]["kernel"]).reshape(B, T, KV, hd)
        k, v = np.repeat(k, H // KV, axis=2), np.repeat(v, H // KV, axis=2)  # query head j uses kv head j // (H/KV)
        s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(hd)
        s = np.where(causal, s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        o = np.einsum("bhts,bshd->bthd", w, v).reshape(B, T, H * hd)
        x = x + o @ b["attn"]["wo"]["kernel"]
        h = rms(x, b["mlp_norm"]["scale"])
        g = h @ b["mlp"]["w_gate"]["kernel"]
        x = x + (g / (1.0 + np.exp(-g)) * (h @ b["mlp"]["w_up"]["kernel"])) @ b["mlp"]["w_down"]["kernel"]
    x = rms(x, p["final_norm"]["scale"])
    return x @ (p["embed"]["embedding"].T if cfg.tie_embeddings else p["lm_head"]["kernel"])


def _perturbed_params(cfg, seed=0):
    """Init with a large std and random norm scales, so every term of the forward pass matters."""
    params = M.init_params(cfg.replace(init_std=0.3), jax.random.key(seed))
    rs = np.random.RandomState(seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x * jnp.asarray(1.0 + 0.5 * rs.randn(*x.shape), x.dtype)
        if fragments.path_str(path).endswith("scale") else x,
        params,
    )


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_matches_numpy_reference(tie):
    cfg = SMALL.replace(tie_embeddings=tie)
    params = _perturbed_params(cfg)
    tokens = _tokens((2, 16), cfg.vocab_size)
    logits = jax.jit(lambda p, t: M.apply(cfg, p, t))(params, tokens)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    ref = _np_forward(cfg, params, tokens)
    assert np.abs(ref).max() > 1.0  # a non-trivial forward pass
    np.testing.assert_allclose(np.asarray(logits), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # the functional API runs exactly the NNX module
    module = M.from_params(cfg, params)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda t: module(t))(tokens)), np.asarray(logits))


def test_bfloat16_compute_keeps_fp32_params_and_logits():
    cfg = SMALL.replace(compute_dtype="bfloat16")
    params = _perturbed_params(cfg)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
    tokens = _tokens((2, 16), cfg.vocab_size)
    logits = jax.jit(lambda p: M.apply(cfg, p, tokens))(params)
    assert logits.dtype == jnp.float32
    ref = _np_forward(cfg, params, tokens)
    assert np.linalg.norm(np.asarray(logits) - ref) / np.linalg.norm(ref) < 0.05


def test_loss_fn_is_masked_mean_cross_entropy():
    params = M.init_params(SMALL, jax.random.key(0))
    tokens, targets = _tokens((2, 8), 64, 1), _tokens((2, 8), 64, 2)
    logits = np.asarray(jax.jit(lambda p: M.apply(SMALL, p, tokens))(params), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, np.asarray(targets)[..., None], -1)[..., 0]
    loss = jax.jit(lambda p, m: M.loss_fn(SMALL, p, tokens, targets, m))
    mask = np.zeros((2, 8), bool)
    mask[:, 3:] = True
    np.testing.assert_allclose(float(loss(params, None)), ce.mean(), rtol=1e-5)
    np.testing.assert_allclose(float(loss(params, mask)), ce[mask].mean(), rtol=1e-5)


# ---------------------------------------------------------------------------
# 3. Scan and remat


def _stack_layers(params, num_layers):
    out = dict(params)
    out["layers"] = jax.tree.map(lambda *xs: jnp.stack(xs), *[params["layers"][i] for i in range(num_layers)])
    return out


def test_scan_layers_matches_unrolled():
    cfg = SMALL.replace(num_layers=3)
    scfg = cfg.replace(scan_layers=True)
    unrolled = _perturbed_params(cfg)
    stacked = _stack_layers(unrolled, 3)
    # same key -> the scanned init is the stacked unrolled init
    key = jax.random.key(3)
    jax.tree.map(np.testing.assert_array_equal, M.init_params(scfg, key), _stack_layers(M.init_params(cfg, key), 3))
    tokens = _tokens((2, 16), cfg.vocab_size)
    a = jax.jit(lambda p: M.apply(cfg, p, tokens))(unrolled)
    b = jax.jit(lambda p: M.apply(scfg, p, tokens))(stacked)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5 * float(jnp.abs(a).max()))


def test_remat_and_scan_give_the_same_gradients():
    cfg = SMALL
    params = M.init_params(cfg.replace(init_std=0.2), jax.random.key(0))
    stacked = _stack_layers(params, cfg.num_layers)
    tokens, targets = _tokens((2, 16), 64, 1), _tokens((2, 16), 64, 2)

    def value_and_grad(c, p):
        return jax.jit(jax.value_and_grad(lambda p: M.loss_fn(c, p, tokens, targets)))(p)

    for c, p in [(cfg.replace(remat=True), params), (cfg.replace(remat=True, scan_layers=True), stacked)]:
        jaxpr = str(jax.make_jaxpr(jax.grad(lambda p, c=c: M.loss_fn(c, p, tokens, targets)))(p))
        assert "remat" in jaxpr and ("scan" in jaxpr) == c.scan_layers  # jax.checkpoint per block / scan body
    l0, g0 = value_and_grad(cfg, params)
    l1, g1 = value_and_grad(cfg.replace(remat=True), params)
    l2, g2 = value_and_grad(cfg.replace(remat=True, scan_layers=True), stacked)
    assert sum(float(jnp.abs(g).sum()) for g in jax.tree.leaves(g0)) > 0
    close = lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose([float(l1), float(l2)], [float(l0)] * 2, rtol=1e-6)
    jax.tree.map(close, g1, g0)
    jax.tree.map(close, g2, _stack_layers(g0, cfg.num_layers))


# ---------------------------------------------------------------------------
# 4. Causality


def test_causal():
    params = _perturbed_params(SMALL)
    tokens = _tokens((2, 16), 64)
    t = 6
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % 64)
    f = jax.jit(lambda x: M.apply(SMALL, params, x))
    a, b = np.asarray(f(tokens)), np.asarray(f(changed))
    np.testing.assert_allclose(b[:, :t], a[:, :t], rtol=0, atol=1e-6)
    assert np.all(np.abs(b[:, t:] - a[:, t:]).max(axis=-1) > 1e-4)  # every later position sees the change


# ---------------------------------------------------------------------------
# 5. Training reduces the loss

_TEXT = b"the quick brown fox jumps over the lazy dog. "


def _byte_batch(batch, seq, stride=5):
    data = np.frombuffer(_TEXT * 40, np.uint8).astype(np.int32)
    rows = np.stack([data[i * stride : i * stride + seq + 1] for i in range(batch)])
    return jnp.asarray(rows[:, :-1]), jnp.asarray(rows[:, 1:])


def test_training_reduces_the_loss():
    cfg = M.CONFIGS["tiny"].replace(d_model=64, d_ff=192, compute_dtype="float32")
    params = M.init_params(cfg, jax.random.key(0))
    tx = optax.adamw(1e-2)
    opt_state = tx.init(params)
    x, y = _byte_batch(8, 32)

    @jax.jit
    def step(params, opt_state):
        loss, grads = jax.value_and_grad(lambda p: M.loss_fn(cfg, p, x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for _ in range(25):
        params, opt_state, loss = jax.block_until_ready(step(params, opt_state))
        losses.append(float(loss))
    assert losses[0] > 5.0  # ~ log(256) at init
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------------------
# 6. loco.compress through nnx.Optimizer under shard_map


def test_nnx_optimizer_with_loco_compress_under_shard_map(data_mesh):
    """``nnx.Optimizer(model, optax.chain(loco.compress(bits=4), optax.adamw(...)), wrt=nnx.Param)``.

    How it works with flax 0.12: ``loco.compress``'s ``init`` must run inside
    ``shard_map`` (it binds the ``data`` axis and makes per-device error
    buffers), so the optimizer is *built* inside ``shard_map`` and carried
    across steps as ``nnx.split`` state:

    - init: ``nnx.merge`` the model from its Param state, construct
      ``nnx.Optimizer``, return ``nnx.split(optimizer)``'s state; its
      ``PartitionSpec`` tree comes from ``loco_jax.specs.output_specs`` (error
      buffers ``P("data")``, everything else ``P()``), and the (static)
      optimizer graphdef is kept from that trace;
    - step: ``nnx.merge`` model and optimizer, take ``nnx.value_and_grad`` on a
      copy of the model whose params are ``lax.pcast(..., "data",
      to="varying")`` (so the gradient stays local and LoCo compresses it),
      then ``optimizer.update(model, grads)`` (the flax >= 0.11 signature),
      and return ``nnx.state(model, nnx.Param)`` and ``nnx.state(optimizer)``.
    """
    mesh = data_mesh
    cfg = M.CONFIGS["tiny"].replace(d_model=64, d_ff=192, compute_dtype="float32", max_seq_len=32)
    model = M.Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.chain(loco.compress(loco.codec(4, compensate=True), axis_name="data"), optax.adamw(3e-3))

    graphdefs = {}

    def init(params):
        optimizer = nnx.Optimizer(nnx.merge(graphdef, params), tx, wrt=nnx.Param)
        graphdefs["opt"], opt_state = nnx.split(optimizer)
        return opt_state

    opt_specs = specs.output_specs(init, params, mesh=mesh, in_specs=(P(),))
    assert P("data") in jax.tree.leaves(opt_specs, is_leaf=lambda s: isinstance(s, P))  # LoCo's error buffers
    opt_state = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=opt_specs))(params)

    def step(params, opt_state, tokens, targets):
        model = nnx.merge(graphdef, params)
        optimizer = nnx.merge(graphdefs["opt"], opt_state)

        def loss_of(m):
            return optax.softmax_cross_entropy_with_integer_labels(m(tokens), targets).mean()

        local = nnx.merge(graphdef, lax.pcast(params, "data", to="varying"))
        loss, grads = nnx.value_and_grad(loss_of)(local)
        optimizer.update(model, grads)  # LoCo's 4-bit all-reduce, then AdamW, then the params
        return nnx.state(model, nnx.Param), nnx.state(optimizer), lax.pmean(loss, "data")

    f = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P(), opt_specs, P("data"), P("data")), out_specs=(P(), opt_specs, P()),
            check_vma=True,
        )
    )
    x, y = _byte_batch(16, 32, stride=3)
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    y = jax.device_put(y, NamedSharding(mesh, P("data")))
    compiled = f.lower(params, opt_state, x, y).compile()

    # gradient-sized collectives are uint8
    report = hlo.collective_bytes(compiled)
    n_params = M.count_params(cfg)
    assert not [op for op in report.ops if op.dtype != "u8" and op.bytes_per_device > 1024], report.table()
    payload = sum(op.total_bytes for op in report.ops if op.dtype == "u8")
    fp32_allreduce = 2 * 7 / 8 * n_params * 4
    assert 0.1 * fp32_allreduce < payload <= 0.14 * fp32_allreduce * 1.05, report.table()

    losses = []
    for _ in range(6):
        params, opt_state, loss = jax.block_until_ready(compiled(params, opt_state, x, y))
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses
    # the parameters stay replicated and the optimizer counted the steps
    assert int(nnx.merge(graphdefs["opt"], opt_state).step[...]) == 6
    assert M.params_of(nnx.merge(graphdef, params))["embed"]["embedding"].shape == (cfg.vocab_size, cfg.d_model)
