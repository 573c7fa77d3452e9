"""FSDP inside a replica: the shard layout, the reduce-scatter on any dimension, clipping over every shard, and
the trainer with ``mesh.fsdp`` against the replicated trainer (exact, fp32), its resume and its HLO."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from loco_jax import fsdp, hlo, loco
from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.run.metrics import read_metrics
from loco_jax.training import model as model_lib
from loco_jax.training.run import checkpoints, steps
from loco_jax.training.run.trainer import Trainer
from tests.helpers import gaussian, put, quiet, rel_err, small_config

D = 8


def test_shard_dims_avoid_the_layer_axis_and_name_a_leaf_that_does_not_divide():
    mcfg = model_lib.ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=2, d_ff=96, max_seq_len=32,
                                 scan_layers=True)
    full = model_lib.abstract_params(mcfg)
    dims = fsdp.shard_dims(full, 8)
    assert dims["layers"]["mlp"]["w_up"]["kernel"] == 2  # (L, 32, 96): the largest dimension, not the layer axis
    assert dims["layers"]["attn"]["wq"]["kernel"] == 1  # (L, 32, 32): the first of equals after the layer axis
    assert dims["layers"]["attn_norm"]["scale"] == 1  # (L, 32)
    assert dims["embed"]["embedding"] == 0  # (256, 32): not a stack, the largest dimension
    specs = fsdp.partition_specs(dims, "data", leading="replica")
    assert specs["layers"]["mlp"]["w_up"]["kernel"] == P("replica", None, "data")
    assert specs["embed"]["embedding"] == P(("replica", "data"))
    with pytest.raises(ValueError, match=r"'layers/w' of shape \(8, 3\) has no dimension after its layer axis"):
        fsdp.shard_dims({"layers": {"w": jax.ShapeDtypeStruct((8, 3), jnp.float32)}}, 8)
    with pytest.raises(ValueError, match="'b' of shape \\(6,\\)"):
        fsdp.shard_dims({"b": jnp.zeros(6)}, 4)


def _scatter(data_mesh, tx, grads_full, dims):
    """Each device's local full gradient (device d: grads_full * (d + 1)) reduced to its shards by ``tx``."""
    specs_in = fsdp.partition_specs(dims, "data")

    def step(g, shard_params):
        scale = (lax.axis_index("data") + 1).astype(jnp.float32)
        local = jax.tree.map(lambda x: lax.pcast(x, "data", to="varying") * scale, g)
        out, _ = tx.update(local, tx.init(shard_params), shard_params)
        return out

    f = jax.jit(jax.shard_map(step, mesh=data_mesh, in_specs=(P(), specs_in), out_specs=specs_in))
    params = jax.tree.map(lambda g, s: put(data_mesh, np.zeros(g.shape, np.float32), s), grads_full, specs_in)
    return jax.tree.map(np.asarray, f(grads_full, params))


GRADS = {"a": gaussian((16, 24), 1), "b": gaussian((3, 16, 8), 2), "c": gaussian((4, 5, 32), 3)}
DIMS = {"a": 0, "b": 1, "c": 2}


@pytest.mark.parametrize("format", ["int", "e3m0", "uniform", "lloyd"])
def test_reduce_scatter_on_any_dimension_is_the_mean_cut_there(data_mesh, format):
    mean = jax.tree.map(lambda g: g * np.mean(np.arange(1, D + 1)), GRADS)
    exact = _scatter(data_mesh, loco.compress(bits=None, reduce="scatter", shard_dims=DIMS), GRADS, DIMS)
    chex.assert_trees_all_close(exact, mean, rtol=1e-6, atol=1e-6)  # global views: the shards put back together
    rotate = format == "lloyd"
    got = _scatter(data_mesh, loco.compress(loco.codec(4, format=format, rotate=rotate), reduce="scatter", shard_dims=DIMS),
                   GRADS, DIMS)
    # one 4-bit rounding of each device's values; they are scaled copies, so the errors do not average out
    bound = {"int": 0.2, "e3m0": 0.35, "uniform": 0.2, "lloyd": 0.15}[format]
    for k in GRADS:
        assert got[k].dtype == np.float32 and rel_err(got[k], mean[k]) < bound, (k, rel_err(got[k], mean[k]))


def test_leaves_bigger_than_a_bucket_are_cut_on_dim_0_and_keep_their_shards(data_mesh):
    """bucket_size=300: "b" (384 values, sharded on dim 1) is cut into rows [0, 2) and [2, 3), "c" (640, on dim 2)
    into rows [0, 1), [1, 3), [3, 4); "a" is sharded on dim 0 and stays whole."""
    mean = jax.tree.map(lambda g: g * np.mean(np.arange(1, D + 1)), GRADS)
    tx = loco.compress(loco.codec(8, format="int", rotate=False), reduce="scatter", shard_dims=DIMS, bucket_size=300)
    got = _scatter(data_mesh, tx, GRADS, DIMS)
    for k in GRADS:
        assert rel_err(got[k], mean[k]) < 0.01, k
    shards = jax.tree.map(lambda g, k: jax.ShapeDtypeStruct(tuple(n // D if i == k else n for i, n in enumerate(g.shape)),
                                                             jnp.float32), GRADS, DIMS)
    state = jax.eval_shape(jax.shard_map(tx.init, mesh=data_mesh, in_specs=(P(),), out_specs=P(), check_vma=False),
                           shards)
    assert len(state.error) == 5  # buckets: a | b[0:2] | b[2:3] + c[0:1] | c[1:3] | c[3:4]


@pytest.mark.parametrize("reduce", ["mean", "scatter"])
def test_buckets_are_worked_one_at_a_time(data_mesh, reduce):
    """Eight leaves in eight buckets: the compiler's temporaries are a fraction of one bucket holding them all
    (each bucket's fp32 working copies exist only while it is worked). With the buckets chained by
    ``optimization_barrier`` XLA:CPU kept them all alive: 0.95 of the one-bucket figure (scatter), 0.38 (mean)."""
    from jax.sharding import NamedSharding

    leaf, n = (256, 512), 8
    scatter = reduce == "scatter"
    shard = (leaf[0] // D,) + leaf[1:] if scatter else leaf

    def temp_bytes(bucket_size):
        tx = loco.compress(bits=4, reduce=reduce, bucket_size=bucket_size)

        def step(g, p):
            return tx.update(g, tx.init(p), p if scatter else None)[0]

        f = jax.jit(jax.shard_map(step, mesh=data_mesh, in_specs=(P("data"), P()),
                                  out_specs=P("data") if scatter else P(("data",)), check_vma=False))
        spec = lambda shape, s: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(data_mesh, s))
        grads = {f"w{i}": spec((D * leaf[0],) + leaf[1:], P("data")) for i in range(n)}  # one full leaf per device
        params = {k: spec(shard, P()) for k in grads}
        return f.lower(grads, params).compile().memory_analysis().temp_size_in_bytes

    one_bucket, per_leaf = temp_bytes(None), temp_bytes(leaf[0] * leaf[1])
    assert per_leaf < 0.3 * one_bucket, (per_leaf, one_bucket)


def test_reduce_scatter_refuses_mismatched_shards(data_mesh):
    with pytest.raises(ValueError, match="shard_dims is for reduce='scatter'"):
        loco.compress(bits=4, shard_dims=DIMS)
    wrong = dict(DIMS, b=0)  # b's dim 0 (3) does not divide by 8
    with pytest.raises(ValueError, match=r"gradient \['b'\] of shape \(3, 16, 8\) is sharded on dim 0"):
        _scatter(data_mesh, loco.compress(bits=4, reduce="scatter", shard_dims=wrong), GRADS, DIMS)


def test_clipping_takes_the_norm_of_the_whole_model(data_mesh):
    tree = {"a": gaussian((16, 24), 4), "b": gaussian((8, 16), 5) * 3}
    dims = {"a": 1, "b": 0}
    specs = fsdp.partition_specs(dims, "data")
    sharded = jax.tree.map(lambda x, s: put(data_mesh, x, s), tree, specs)
    for max_norm in (1.0, 1e4):  # clipped, and left alone
        tx = fsdp.clip_by_global_norm(max_norm, "data")
        f = jax.jit(jax.shard_map(lambda u: tx.update(u, tx.init(u))[0], mesh=data_mesh, in_specs=(specs,),
                                  out_specs=specs))
        want = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())[0]
        chex.assert_trees_all_close(jax.tree.map(np.asarray, f(sharded)), want, rtol=1e-6)
    with pytest.raises(ValueError, match="max_norm=0"):
        fsdp.clip_by_global_norm(0)


def test_replicated_clipping_sums_the_norm_as_fsdp_does(data_mesh):
    """slice_dims: whole updates on every device clip bit-for-bit like their FSDP shards (same order of sums)."""
    tree = {"a": gaussian((16, 24), 6), "b": gaussian((8, 16), 7) * 3}
    dims = {"a": 1, "b": 0}
    specs = fsdp.partition_specs(dims, "data")
    run = lambda tx, in_specs, x: jax.jit(jax.shard_map(  # noqa: E731
        lambda u: tx.update(u, tx.init(u))[0], mesh=data_mesh, in_specs=(in_specs,), out_specs=in_specs))(x)
    sharded = run(fsdp.clip_by_global_norm(1.0, "data"), specs,
                  jax.tree.map(lambda x, sp: put(data_mesh, x, sp), tree, specs))
    whole = jax.tree.map(lambda _: P(), tree)
    replicated = run(fsdp.clip_by_global_norm(1.0, "data", slice_dims=dims), whole,
                     jax.tree.map(lambda x: put(data_mesh, x, P()), tree))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, replicated),
                 jax.tree.map(np.asarray, sharded))
    want = optax.clip_by_global_norm(1.0).update(tree, optax.EmptyState())[0]
    chex.assert_trees_all_close(jax.tree.map(np.asarray, replicated), want, rtol=1e-6)


def test_accumulated_gradient_is_the_batch_gradient():
    mcfg = model_lib.ModelConfig(vocab_size=256, d_model=32, num_layers=2, num_heads=2, d_ff=96, max_seq_len=16,
                                 compute_dtype="float32")
    params = model_lib.init_params(mcfg, jax.random.PRNGKey(0))
    x = jax.random.randint(jax.random.PRNGKey(1), (8, 16), 0, 256)
    y = jnp.roll(x, -1, axis=1)
    grads = lambda p, k: steps.loss_and_grad(steps.local_grad_fn(mcfg, p), x, y, k)
    one, four = jax.jit(lambda p: (grads(p, 1), grads(p, 4)))(params)
    chex.assert_trees_all_close(four, one, rtol=2e-5, atol=1e-7)


def test_bad_accumulation_is_refused_before_compiling(text_file):  # noqa: F811
    cfg = small_config(text_file, accum_steps=3)  # 16 sequences over 8 devices: 2 each
    with pytest.raises(ValueError, match="accum_steps=3 must divide the 2 sequences each device gets"):
        Trainer(cfg, "/nonexistent")


# ------------------------------------------------------------------------------------------ the trainer

EXACT = {"loco.bits": "none", "diloco.bits": "none", "model.scan_layers": True, "steps": 6, "log_every": 1,
         "eval_every": 6, "checkpoint_every": 3, "diloco.sync_every": 4, "diloco.num_fragments": 2}


@pytest.fixture(scope="module")
def runs(text_file, tmp_path_factory):  # noqa: F811
    """Streaming DiLoCo, exact exchanges, fp32, clipping on: replicated, and FSDP straight and resumed."""
    out = {}
    for name, kw in (("replicated", {}), ("fsdp", {"mesh.fsdp": True})):
        workdir = str(tmp_path_factory.mktemp(name))
        train_and_evaluate(small_config(text_file, **EXACT, **kw), workdir, log=quiet)
        out[name] = workdir
    resumed = str(tmp_path_factory.mktemp("resumed"))
    cfg = small_config(text_file, **EXACT, **{"mesh.fsdp": True})
    train_and_evaluate(cfg, resumed, log=quiet, stop_after=3)
    train_and_evaluate(cfg, resumed, log=quiet)
    out["resumed"] = resumed
    return out


def _losses(workdir, key="loss"):
    return [r[key] for r in read_metrics(workdir) if key in r]


def test_fsdp_matches_the_replicated_trainer_and_resumes_bit_identically(runs):
    rep, sharded = _losses(runs["replicated"]), _losses(runs["fsdp"])
    assert len(rep) == 6 and rep[-1] < rep[0]
    # bit-identical: the same initial parameters (one compiled init), the same clipping norm order, and an
    # exact reduce-scatter that sums what the all-reduce sums
    assert sharded == rep
    assert _losses(runs["fsdp"], "eval_loss") == _losses(runs["replicated"], "eval_loss")
    assert _losses(runs["resumed"]) == sharded and _losses(runs["resumed"], "eval_loss") == _losses(runs["fsdp"], "eval_loss")


def test_fsdp_state_is_sharded_like_the_parameters(text_file):  # noqa: F811
    t = Trainer(small_config(text_file, **EXACT, **{"mesh.fsdp": True}), "/nonexistent")
    state = t.abstract_state()
    w_up = ("layers", "mlp", "w_up", "kernel")
    get = lambda tree: tree[w_up[0]][w_up[1]][w_up[2]][w_up[3]]
    assert get(t.specs.params) == P("replica", None, "data")
    adam = [n for n in jax.tree.leaves(t.specs.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(n, optax.ScaleByAdamState)]
    assert len(adam) == 1 and get(adam[0].mu) == get(adam[0].nu) == P("replica", None, "data")
    assert get(t.specs.opt_state.global_params) == P(None, None, "data")
    # each device holds 1/8 of the layer stack's values (2 replicas x 4 data devices; 1/4 within a replica)
    shard = get(state.params).sharding.shard_shape(get(state.params).shape)
    assert shard == (2, 32, 96 // 4)


def test_samples_come_from_the_sharded_global_parameters(runs):
    """train.py --sample on an FSDP workdir: the sharded global parameters are gathered to one device; the
    greedy continuation equals the replicated run's (the two runs hold the same parameters to the bit)."""
    from loco_jax.training.run import sample_command

    got = sample_command.sample_workdir(runs["fsdp"], log=quiet, prompts=["the "], length=8, temperature=0.0)
    want = sample_command.sample_workdir(runs["replicated"], log=quiet, prompts=["the "], length=8, temperature=0.0)
    assert got and got == want


def test_an_fsdp_checkpoint_on_another_mesh_is_refused_by_name(runs, text_file):  # noqa: F811
    cfg = small_config(text_file, **EXACT, **{"mesh.fsdp": True, "mesh.replicas": 1, "diloco.enabled": True})
    t = Trainer(cfg, runs["fsdp"])
    manager = checkpoints.checkpoint_manager(runs["fsdp"], 2)
    with pytest.raises(ValueError, match="elastic restart of an FSDP run .* is not supported"):
        checkpoints.restore_step(manager, manager.latest_step(), t, quiet)
    manager.close()


def test_fsdp_step_sends_uint8_gradients_and_no_fp32_reduction(text_file):  # noqa: F811
    """LoCo 4-bit under FSDP: the gradient crosses as uint8 all-to-all; the fp32 traffic left is the
    parameter all-gather (the compute dtype) and scalars."""
    t = Trainer(small_config(text_file, **{"mesh.fsdp": True, "mesh.replicas": 1, "diloco.enabled": False}),
                "/nonexistent")
    report = hlo.collective_bytes(t.program(None, t.abstract_state(), t.abstract_batch()))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model_lib.abstract_params(t.mcfg)))
    payload = [op for op in report.ops if op.dtype == "u8"]
    assert payload and all(op.kind in ("all-to-all", "all-gather") for op in payload), report.table()
    # (a psum over the size-1 replica axis stays in the program; it moves no bytes)
    reductions = [op for op in report.ops if op.dtype != "u8" and op.kind in ("all-reduce", "reduce-scatter")
                  and op.total_bytes > 64]
    assert not reductions, report.table()
    gathers = sum(op.total_bytes for op in report.ops if op.dtype == "f32" and op.kind == "all-gather")
    assert gathers <= 7 / 8 * n * 4 * 1.01, report.table()  # the parameters, once, in fp32 compute
    u8 = sum(op.total_bytes for op in payload)
    assert u8 <= 7 / 8 * n * (4 + 32 / 256) / 8 * 1.2, report.table()  # reduce-scatter only: half an all-reduce


def test_hierarchical_data_parallel_is_low_bit_only_across_hosts(text_file, tmp_path):  # noqa: F811
    """mesh.local=4: 2 simulated hosts x 4 devices; LoCo exact over a host's devices, 4-bit across hosts."""
    cfg = small_config(text_file, steps=4, log_every=1, eval_every=4, checkpoint_every=4,
                       **{"mesh.replicas": 1, "diloco.enabled": False, "mesh.data": 2, "mesh.local": 4})
    train_and_evaluate(cfg, str(tmp_path), log=quiet)
    losses = _losses(str(tmp_path))
    assert len(losses) == 4 and losses[-1] < losses[0]
    t = Trainer(cfg, str(tmp_path))
    assert dict(t.mesh.shape) == {"replica": 1, "data": 2, "local": 4}
    report = hlo.collective_bytes(t.program(None, t.abstract_state(), t.abstract_batch()))
    across = [op for op in report.ops if op.spans(4) and op.total_bytes > 0]
    assert any(op.dtype == "u8" for op in across), report.table()
    assert all(op.dtype == "u8" or op.payload_bytes <= 16 for op in across), report.table()  # scalars only
    with pytest.raises(ValueError, match="mesh.local=4 .* is for data parallel"):
        Trainer(small_config(text_file, **{"mesh.local": 4}), str(tmp_path))


def test_the_8b_recipe_shards_its_state_to_an_eighth_plus_the_error_buffer():
    """configs/diloco_8b.py on one replica of 8 devices, traced abstractly (nothing compiles or allocates):
    every device holds 1/8 of parameters, moments, global parameters and outer momentum, plus LoCo's
    full-size 8-bit error buffer."""
    import os

    from loco_jax.training.run import config as config_lib

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = config_lib.load(os.path.join(root, "configs", "diloco_8b.py"), ["mesh.replicas=1", "mesh.data=8",
                                                                         "batch_size=64"])
    t = Trainer(cfg, "/nonexistent")
    state = t.abstract_state()
    per_device = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(state))
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(model_lib.abstract_params(t.mcfg)))
    assert n > 8.0e9
    sharded = 4 * n * (1 + 2 + 1 + 1) / 8  # parameters, AdamW moments, global parameters, outer momentum
    error = n * (1 + 4 / 256)  # 8-bit codes and a scale per 256 values, not sharded
    assert abs(per_device - (sharded + error)) / (sharded + error) < 0.01, (per_device / 2**30, (sharded + error) / 2**30)
    replicated = 4 * n * 5 + error
    assert per_device <= (replicated - error) / 8 + error * 1.01
