"""Fragment plans (docs/algorithms.md, "6. DiLoCo and Streaming DiLoCo"): detection, assignment, extract/insert, validation."""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loco_jax import fragments as F
from loco_jax.training import shapes

# ---------------------------------------------------------------------------
# Helpers and small trees
# ---------------------------------------------------------------------------


def materialize(shapes, start=1.0):
    """Real arrays for a tree of shapes: every value distinct and positive (start, start+1, ...)."""
    leaves, treedef = jax.tree.flatten(shapes)
    out, off = [], start
    for s in leaves:
        n = int(np.prod(s.shape))
        out.append(np.arange(off, off + n, dtype=np.float32).reshape(s.shape).astype(s.dtype))
        off += n
    return jax.tree.unflatten(treedef, out)


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def flat_named(num_blocks=6):
    """Flat dict keys 'layers_0' ... (an unrolled Flax linen style tree)."""
    tree = {"embed": sds(10, 4), "head": sds(4, 10)}
    for i in range(num_blocks):
        tree[f"layers_{i}"] = {"w": sds(4, 4), "b": sds(4)}
    return tree


def block_list(num_blocks=6):
    """A list of blocks: paths 'blocks/3/mlp/w' (SequenceKey)."""
    return {
        "embed": sds(10, 4),
        "blocks": [{"mlp": {"w": sds(4, 3)}, "norm": sds(4)} for _ in range(num_blocks)],
        "norm": sds(4),
    }


def scanned(num_blocks=6):
    return {"embed": sds(10, 4), "layers": {"w": sds(num_blocks, 4, 4), "b": sds(num_blocks, 4)}, "norm": sds(4)}


def small_transformer(scan_layers=False, num_layers=6):
    return shapes.transformer_shapes(
        num_layers=num_layers, d_model=8, num_heads=2, num_kv_heads=1, d_ff=16, vocab_size=11,
        scan_layers=scan_layers,
    )


Pair = collections.namedtuple("Pair", ["encoder", "head"])  # GetAttrKey paths

TREES = {
    "flat_named": flat_named,
    "block_list": block_list,
    "scanned": scanned,
    "transformer": small_transformer,
    "transformer_scanned": functools.partial(small_transformer, True),
    "uneven7": functools.partial(flat_named, 7),
    "namedtuple": lambda: Pair(encoder={"h": [{"w": sds(3, 2)} for _ in range(6)]}, head=sds(2, 5)),
    "dotted": lambda: {"tok.embed": sds(5, 2), **{f"layers.{i}.attn.w": sds(2, 2) for i in range(6)}},
}

PLANS = [(t, P, s) for t in TREES for P in (1, 2, 4) for s in F.STRATEGIES]


def fragments_of_blocks(pl):
    return {p: set(pl.fragment_blocks(p)) for p in range(1, pl.num_fragments)}


def leaf_label(pl, path):
    return pl.leaf_labels[pl.leaf_paths.index(path)]


# ---------------------------------------------------------------------------
# The 1B model
# ---------------------------------------------------------------------------


def test_1b_parameter_count():
    tree = shapes.llama_1b_shapes()
    assert F.count_params(tree) == shapes.LLAMA_1B_NUM_PARAMS == 1_364_297_728
    assert F.count_params(shapes.llama_1b_shapes(scan_layers=True)) == shapes.LLAMA_1B_NUM_PARAMS
    assert shapes.LLAMA_1B["d_ff"] == -(-8 * 2048 // 3 // 256) * 256 == 5632  # round_up(8/3 d, 256)
    assert tree["layers"][0]["attn"]["wk"]["kernel"].shape == (2048, 2048)
    assert "lm_head" not in shapes.transformer_shapes(**shapes.LLAMA_1B, tie_embeddings=True)
    gqa = shapes.transformer_shapes(**shapes.LLAMA_1B, num_kv_heads=4)
    assert gqa["layers"][3]["attn"]["wv"]["kernel"].shape == (2048, 512)


def test_1b_plan_nine_fragments():
    tree = shapes.llama_1b_shapes()
    pl = F.plan(tree, 9)
    sizes = pl.fragment_sizes()
    assert sizes[0] == 2 * 32000 * 2048 + 2048  # embed + lm_head + final_norm
    block = 4 * 2048 * 2048 + 3 * 2048 * 5632 + 2 * 2048
    assert sizes[1:] == (3 * block,) * 8
    assert sum(sizes) == F.count_params(tree)
    assert pl.num_layers == 24
    assert fragments_of_blocks(pl)[1] == {0, 8, 16}
    assert all(len(b) == 3 for b in fragments_of_blocks(pl).values())
    for path in ("embed/embedding", "final_norm/scale", "lm_head/kernel"):
        assert leaf_label(pl, path) == 0
    for b in (0, 8, 16):
        assert leaf_label(pl, f"layers/{b}/mlp/w_up/kernel") == 1
    assert leaf_label(pl, "layers/23/attn/wq/kernel") == 8
    text = pl.describe(tree)
    assert "blocks 0, 8, 16" in text and "embed/embedding" in text and "1,364,297,728" in text


def test_1b_scanned_plan_matches_unrolled():
    unrolled, stacked = F.plan(shapes.llama_1b_shapes(), 9), F.plan(shapes.llama_1b_shapes(scan_layers=True), 9)
    assert stacked.fragment_sizes() == unrolled.fragment_sizes()
    np.testing.assert_array_equal(leaf_label(stacked, "layers/mlp/w_down/kernel"), np.tile(np.arange(1, 9), 3))
    assert fragments_of_blocks(stacked) == fragments_of_blocks(unrolled)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_1b_abstract_extract_insert(scan_layers):
    """Shapes only: eval_shape traces extract/insert of a 1.4B-parameter tree without allocating it."""
    tree = shapes.llama_1b_shapes(scan_layers=scan_layers)
    pl = F.plan(tree, 9)
    out = jax.eval_shape(lambda t: pl.extract(t, 1), tree)
    assert out.shape == (pl.fragment_sizes()[1],) and out.dtype == jnp.float32
    back = jax.eval_shape(lambda t, f: pl.insert(t, 1, f), tree, out)
    assert jax.tree.map(lambda s: (s.shape, s.dtype), back) == jax.tree.map(lambda s: (s.shape, s.dtype), tree)


# ---------------------------------------------------------------------------
# Detection and assignment on small trees
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["flat_named", "block_list", "scanned", "transformer", "transformer_scanned",
                                  "namedtuple", "dotted"])
def test_strided_and_sequential_six_blocks(name):
    tree = TREES[name]()
    strided = F.plan(tree, 4)
    sequential = F.plan(tree, 4, strategy="sequential")
    assert strided.num_layers == sequential.num_layers == 6
    assert fragments_of_blocks(strided) == {1: {0, 3}, 2: {1, 4}, 3: {2, 5}}
    assert fragments_of_blocks(sequential) == {1: {0, 1}, 2: {2, 3}, 3: {4, 5}}
    assert sum(strided.fragment_sizes()) == sum(sequential.fragment_sizes()) == F.count_params(tree)


def test_detected_leaf_labels():
    pl = F.plan(flat_named(), 4)
    assert leaf_label(pl, "embed") == 0 and leaf_label(pl, "head") == 0
    assert leaf_label(pl, "layers_4/w") == 2 and leaf_label(pl, "layers_5/b") == 3
    pl = F.plan(block_list(), 4, strategy="sequential")
    assert leaf_label(pl, "blocks/3/mlp/w") == 2 and leaf_label(pl, "norm") == 0
    pl = F.plan(scanned(), 4)
    np.testing.assert_array_equal(leaf_label(pl, "layers/w"), [1, 2, 3, 1, 2, 3])
    assert pl.fragment_sizes() == (10 * 4 + 4, 2 * 20, 2 * 20, 2 * 20)
    pl = F.plan(TREES["namedtuple"](), 4)
    assert leaf_label(pl, "encoder/h/5/w") == 3 and leaf_label(pl, "head") == 0
    pl = F.plan(TREES["dotted"](), 4)
    assert leaf_label(pl, "layers.4.attn.w") == 2 and leaf_label(pl, "tok.embed") == 0


def test_uneven_seven_blocks():
    tree = flat_named(7)
    strided = F.plan(tree, 4)
    sequential = F.plan(tree, 4, strategy="sequential")
    assert fragments_of_blocks(strided) == {1: {0, 3, 6}, 2: {1, 4}, 3: {2, 5}}
    assert fragments_of_blocks(sequential) == {1: {0, 1, 2}, 2: {3, 4}, 3: {5, 6}}
    assert strided.fragment_sizes() == (80, 60, 40, 40)
    st = F.plan(scanned(7), 4, strategy="sequential", num_layers=7)
    np.testing.assert_array_equal(leaf_label(st, "layers/b"), [1, 1, 1, 2, 2, 3, 3])


def test_one_fragment_holds_everything():
    for make in TREES.values():
        tree = make()
        pl = F.plan(tree, 1)
        assert pl.fragment_sizes() == (F.count_params(tree),)
        assert all(lab == 0 for lab in pl.leaf_labels)
    # No blocks are needed for P = 1.
    assert F.plan({"w": sds(3, 3)}, 1).fragment_sizes() == (9,)


def test_explicit_labels_pytree_and_callable():
    tree = {"a": sds(2, 3), "b": {"c": sds(4), "stack": sds(3, 2)}}
    labels = {"a": 2, "b": {"c": 0, "stack": np.array([1, 2, 1])}}
    pl = F.plan(tree, 3, labels=labels)
    assert pl.leaf_labels[0] == 2 and pl.leaf_labels[1] == 0
    np.testing.assert_array_equal(pl.leaf_labels[2], [1, 2, 1])
    assert pl.fragment_sizes() == (4, 4, 6 + 2)
    # The callable form.
    pl2 = F.plan(tree, 2, labels=lambda params: {"a": 0, "b": jax.tree.map(lambda _: 1, params["b"])})
    assert pl2.fragment_sizes() == (6, 10)
    # Labels override detection and may cut a scanned leaf any way.
    pl3 = F.plan(scanned(), 3, labels={"embed": 0, "norm": 0, "layers": {"w": np.array([1, 2, 1, 1, 2, 2]), "b": 1}})
    assert pl3.fragment_sizes() == (44, 3 * 16 + 6 * 4, 3 * 16)


def test_plan_is_hashable_and_immutable():
    a, b = F.plan(scanned(), 4), F.plan(scanned(), 4)
    assert a == b and hash(a) == hash(b)
    assert a != F.plan(scanned(), 4, strategy="sequential")
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.num_fragments = 3
    with pytest.raises(ValueError):
        a.leaf_labels[1][0] = 5  # read-only label arrays


# ---------------------------------------------------------------------------
# Masks, extract and insert
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name,P,strategy", PLANS)
def test_masks_partition_every_value(name, P, strategy):
    tree = TREES[name]()
    pl = F.plan(tree, P, strategy=strategy)
    masks = [pl.mask(tree, p) for p in range(P)]
    total = jax.tree.map(lambda *ms: sum(m.astype(np.int32) for m in ms), *masks)
    for leaf in jax.tree.leaves(total):
        np.testing.assert_array_equal(leaf, 1)
    for p, m in enumerate(masks):
        assert sum(int(x.sum()) for x in jax.tree.leaves(m)) == pl.fragment_sizes()[p]


@pytest.mark.parametrize("name,P,strategy", PLANS)
def test_extract_insert(name, P, strategy):
    shapes = TREES[name]()
    tree = materialize(shapes)
    pl = F.plan(shapes, P, strategy=strategy)
    total = F.count_params(shapes)
    parts = []
    for p in range(P):
        flat = pl.extract(tree, p)
        assert flat.shape == (pl.fragment_sizes()[p],) and flat.dtype == jnp.float32
        parts.append(np.asarray(flat))
        # Round trip.
        same = pl.insert(tree, p, flat)
        jax.tree.map(np.testing.assert_array_equal, same, tree)
        # New values change exactly fragment p's values.
        new_vals = -1.0 - jnp.arange(flat.size, dtype=jnp.float32)
        new = pl.insert(tree, p, new_vals)
        mask = pl.mask(tree, p)
        for old, upd, m in zip(jax.tree.leaves(tree), jax.tree.leaves(new), jax.tree.leaves(mask)):
            upd = np.asarray(upd)
            np.testing.assert_array_equal(upd[~m], np.asarray(old)[~m])
            assert np.all(upd[m] < 0)
        np.testing.assert_array_equal(pl.extract(new, p), new_vals)
    # All fragments together cover every value exactly once.
    everything = np.concatenate(parts)
    assert everything.size == total
    np.testing.assert_array_equal(np.sort(everything), np.arange(1, total + 1, dtype=np.float32))


def test_extract_order_is_flatten_order_then_increasing_slices():
    tree = materialize(scanned())
    pl = F.plan(tree, 4)
    got = np.asarray(pl.extract(tree, 2))
    want = np.concatenate([tree["layers"]["b"][[1, 4]].ravel(), tree["layers"]["w"][[1, 4]].ravel()])
    np.testing.assert_array_equal(got, want)
    pieces = pl.select(tree, 2)
    assert [p.shape for p in pieces] == [(2, 4), (2, 4, 4)]


def test_extract_insert_under_jit():
    shapes = scanned()
    tree = jax.tree.map(jnp.asarray, materialize(shapes))
    # Non-arithmetic slice sets take the gather/scatter path; strided ones a strided slice.
    labels = {"embed": 0, "norm": 0, "layers": {"w": np.array([1, 2, 1, 1, 2, 2]), "b": np.array([1, 1, 2, 2, 1, 2])}}
    for pl in (F.plan(shapes, 4), F.plan(shapes, 3, labels=labels)):
        for p in range(pl.num_fragments):
            ex = jax.jit(lambda t, p=p: pl.extract(t, p))
            ins = jax.jit(lambda t, f, p=p: pl.insert(t, p, f))
            flat = ex(tree)
            np.testing.assert_array_equal(flat, pl.extract(tree, p))
            new = ins(tree, flat * 2)
            ref = pl.insert(tree, p, flat * 2)
            jax.tree.map(np.testing.assert_array_equal, new, ref)

    # The plan itself can be a static argument.
    @functools.partial(jax.jit, static_argnums=(0, 2))
    def scale_fragment(pl, t, p):
        return pl.insert(t, p, pl.extract(t, p) * 0.5)

    pl = F.plan(shapes, 4)
    out = scale_fragment(pl, tree, 3)
    m = pl.mask(tree, 3)
    for a, b, mm in zip(jax.tree.leaves(out), jax.tree.leaves(tree), jax.tree.leaves(m)):
        np.testing.assert_array_equal(np.asarray(a), np.where(mm, np.asarray(b) * 0.5, np.asarray(b)))


def test_extract_casts_to_float32_and_insert_casts_back():
    shapes = {"embed": sds(4, 2, dtype=jnp.bfloat16), "layers": {"w": sds(3, 2, dtype=jnp.bfloat16)}}
    tree = materialize(shapes)
    pl = F.plan(shapes, 4)
    flat = pl.extract(tree, 1)
    assert flat.dtype == jnp.float32
    assert pl.extract(tree, 1, dtype=jnp.bfloat16).dtype == jnp.bfloat16
    back = pl.insert(tree, 1, flat + 0.25)
    assert back["layers"]["w"].dtype == jnp.bfloat16 and back["embed"] is tree["embed"]


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_bad_num_fragments(bad):
    with pytest.raises(ValueError, match="num_fragments=.* must be a positive int"):
        F.plan(scanned(), bad)


def test_bad_strategy():
    with pytest.raises(ValueError, match=r"strategy='random' is unknown.*strided.*sequential"):
        F.plan(scanned(), 4, strategy="random")


def test_no_blocks():
    with pytest.raises(ValueError, match="no transformer blocks.*labels="):
        F.plan({"w": sds(3, 3), "mlp": {"b": sds(3)}}, 2)


def test_too_many_fragments_names_the_empty_ones():
    with pytest.raises(ValueError, match=r"6 transformer blocks.*fragment\(s\) 7, 8"):
        F.plan(flat_named(6), 9)
    with pytest.raises(ValueError, match=r"fragment\(s\) 4, 8"):  # floor(i * 8 / 6) skips 3 and 7
        F.plan(scanned(6), 9, strategy="sequential")


def test_scanned_leaves_disagree():
    tree = {"embed": sds(3), "layers": {"w": sds(6, 2), "b": sds(5)}}
    with pytest.raises(ValueError, match="disagree.*layers/b: 5.*layers/w: 6"):
        F.plan(tree, 3)
    with pytest.raises(ValueError, match="scalar"):
        F.plan({"embed": sds(3), "layers": {"w": sds()}}, 2)


def test_num_layers_mismatch():
    with pytest.raises(ValueError, match="num_layers=8.*layers/b"):
        F.plan(scanned(6), 3, num_layers=8)
    with pytest.raises(ValueError, match="num_layers=8.*6 blocks"):
        F.plan(flat_named(6), 3, num_layers=8)


def test_non_contiguous_blocks():
    tree = {"embed": sds(3), "layers_0": sds(2), "layers_2": sds(2)}
    with pytest.raises(ValueError, match="contiguous 0..2.*blocks 1 are missing"):
        F.plan(tree, 2)


def test_fragment_zero_empty_without_non_block_leaves():
    with pytest.raises(ValueError, match=r"fragment\(s\) 0 .*would be empty.*none"):
        F.plan({"layers": {"w": sds(4, 2)}}, 3)


def test_bad_labels():
    tree = {"a": sds(2, 3), "b": {"c": sds(4), "stack": sds(3, 2)}}
    with pytest.raises(ValueError, match=r"leaf 'b/c' has label 5, outside \[0, 3\)"):
        F.plan(tree, 3, labels={"a": 1, "b": {"c": 5, "stack": 2}})
    with pytest.raises(ValueError, match=r"leaf 'b/stack' has slice label\(s\) -1"):
        F.plan(tree, 3, labels={"a": 1, "b": {"c": 0, "stack": np.array([1, -1, 2])}})
    with pytest.raises(ValueError, match=r"structure does not match.*without a label: \['b/stack'\]"):
        F.plan(tree, 3, labels={"a": 1, "b": {"c": 0}})
    with pytest.raises(ValueError, match=r"structure does not match"):
        F.plan(tree, 3, labels=lambda params: [0, 1, 2])
    with pytest.raises(ValueError, match=r"fragment\(s\) 1 of num_fragments=3 would be empty"):
        F.plan(tree, 3, labels={"a": 0, "b": {"c": 2, "stack": 2}})
    with pytest.raises(ValueError, match=r"leaf 'b/stack' has a per-slice label array of length 2.*dimension is 3"):
        F.plan(tree, 3, labels={"a": 1, "b": {"c": 0, "stack": np.array([1, 2])}})
    with pytest.raises(ValueError, match=r"leaf 'a' .*must be integers"):
        F.plan(tree, 3, labels={"a": 1.0, "b": {"c": 0, "stack": 2}})


def test_bad_extract_insert_arguments():
    shapes = scanned()
    tree = materialize(shapes)
    pl = F.plan(shapes, 4)
    with pytest.raises(ValueError, match=r"p=4 must be a Python int in \[0, 4\)"):
        pl.extract(tree, 4)
    with pytest.raises(ValueError, match="fragment 1 holds 40 values"):
        pl.insert(tree, 1, jnp.zeros(39))
    with pytest.raises(ValueError, match="structure does not match"):
        pl.extract({"embed": tree["embed"]}, 0)
    with pytest.raises(ValueError, match=r"leaf 'layers/w' has shape \(5, 4, 4\)"):
        pl.extract({**tree, "layers": {"w": np.zeros((5, 4, 4)), "b": tree["layers"]["b"]}}, 0)


def test_bad_transformer_shapes():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        shapes.transformer_shapes(d_model=10, num_heads=4)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        shapes.transformer_shapes(num_kv_heads=3)
