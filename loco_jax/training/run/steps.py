"""The pure step functions and the optimizer a config builds: ``train_step`` and ``eval_step`` run inside
``shard_map``; ``make_optimizer`` is LoCo (or the exact mean) on ``data``, clipping and AdamW, wrapped in
Streaming DiLoCo on ``replica`` when the config enables it.

The step recipe of the README: parameters are cast to varying over ``data`` before ``jax.grad``, so no
hidden fp32 psum runs; the optimizer's collectives are the only ones.

FSDP (``mesh.fsdp``, :mod:`loco_jax.fsdp`): ``params`` are this device's shards; the step all-gathers the
full parameters once, in the compute dtype, outside ``jax.grad`` (a gather inside it would transpose into
an exact reduce-scatter of the gradient that bypasses LoCo), and ``loco.compress(reduce="scatter")``
returns the mean gradient's shards. Gradient accumulation (``accum_steps``) sums the micro-batches'
gradients in fp32 before the one optimizer step.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from loco_jax import backward, fragments, fsdp, loco, nonfinite, specs
from loco_jax import collectives as coll
from loco_jax.training import model as model_lib
from loco_jax.training.run import config as config_lib
from loco_jax.training.run import strategy

BATCH_SPEC = P(("replica", "data"))  # the batch over a (replica, data) mesh; batch_spec(mesh) for any mesh


def batch_spec(mesh):
    """Dim 0 of the batch split over every mesh axis, in mesh order."""
    return P(tuple(mesh.axis_names))


def _data_axes():
    """The axes of one replica's devices bound by the enclosing shard_map (``data``, and ``local`` if any)."""
    return tuple(a for a in specs.manual_axes() if a != "replica")


class TrainState(NamedTuple):
    params: Any
    opt_state: Any


def muon_dims(params):
    """Which leaves Muon orthogonalizes, and how: the transformer blocks' matrices (a scanned stack's leading
    layer axis is a batch axis); None (AdamW) for the embedding, the head and every norm scale."""
    def one(path, x):
        keys = fragments.path_str(path).split("/")
        if "layers" in keys and keys[-1] == "kernel" and x.ndim >= 2:
            return optax.contrib.MuonDimensionNumbers(reduction_axis=x.ndim - 2, output_axis=x.ndim - 1)
        return None
    return jax.tree_util.tree_map_with_path(one, params)


def inner_update_rule(cfg: config_lib.Config) -> optax.GradientTransformation:
    """The inner optimizer's update (after LoCo and clipping): AdamW, or Muon on the blocks' matrices with
    AdamW on the rest (config.OptimFields)."""
    o = cfg.optim
    if o.name == "muon":
        return optax.contrib.muon(
            learning_rate_schedule(cfg), beta=o.muon_beta, weight_decay=o.weight_decay, adam_b1=o.b1, adam_b2=o.b2,
            adam_weight_decay=o.weight_decay, muon_weight_dimension_numbers=muon_dims, consistent_rms=0.2)
    return optax.adamw(learning_rate_schedule(cfg), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)


def learning_rate_schedule(cfg: config_lib.Config):
    """Linear warm-up to ``optim.lr``, cosine decay to ``lr * min_lr_ratio`` at ``steps``.

    A warm-up of ``steps`` or more is shortened to ``steps - 1`` (the trainer logs it): the peak is reached.
    """
    o = cfg.optim
    warmup = min(o.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def bucket_groups(params):
    """The buckets of the in-backward exchange (``compress(groups=...)``) of a model with scanned layers: the
    embedding alone (0), the final norm and output head (1), then one bucket per layer of the stack
    (:data:`loco_jax.loco.STACK`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: loco.STACK if path[0].key == "layers" else 0 if path[0].key == "embed" else 1, params)


def make_exchanger(cfg: config_lib.Config, shard_dims=None, groups=None) -> loco.Exchanger:
    """``loco.compress`` of the config on ``data`` (its :class:`loco_jax.loco.Exchanger`); ``groups``: the
    in-backward buckets (:func:`bucket_groups`), None for the config's ``bucket_size`` buckets."""
    c = cfg.loco
    codec = loco.codec(c.bits, preset=c.preset, format=c.format, rotate=c.rotate, beta=c.beta, compensate=c.compensate,
                       compensate_second_stage=c.compensate_second_stage, error_bits=c.error_bits,
                       block_size=c.block_size, seed=cfg.seed)
    return loco.exchanger(
        bits=codec, axis_name="data", reset_every=c.reset_every, bucket_size=c.bucket_size,
        **(dict(reduce="scatter", shard_dims=shard_dims) if shard_dims is not None else {}),
        **(dict(fast_axis="local") if cfg.mesh.local > 1 else {}), groups=groups,
    )


def make_optimizer(cfg: config_lib.Config, shard_dims=None, norm_dims=None, groups=None):
    """The step's optax transformation: LoCo (or exact mean) on ``data``, clip, AdamW; DiLoCo outside.

    ``shard_dims`` (FSDP, :func:`loco_jax.fsdp.shard_dims`): LoCo reduce-scatters to those shards, clipping
    takes the norm over every shard, and DiLoCo exchanges each device's own shard over ``replica``.
    ``norm_dims`` (replicated layout): the shards FSDP would cut; clipping squares each device's own one of
    them and sums over ``data``, so switching FSDP on or off leaves the clipping norm bit-identical
    (:func:`loco_jax.fsdp.clip_by_global_norm`). None: ``optax.clip_by_global_norm``. ``groups``: LoCo's
    buckets (:func:`bucket_groups` for the in-backward exchange).
    """
    o = cfg.optim
    sharded = shard_dims is not None
    parts = [make_exchanger(cfg, shard_dims, groups).transformation]
    if o.grad_clip is not None:
        if sharded or norm_dims is not None:
            parts.append(fsdp.clip_by_global_norm(o.grad_clip, "data", slice_dims=norm_dims))
        else:
            parts.append(optax.clip_by_global_norm(o.grad_clip))
    parts.append(inner_update_rule(cfg))
    inner = optax.chain(*parts)
    return strategy.of(cfg).wrap(inner, sharded)


def model_config(cfg: config_lib.Config, device=None) -> model_lib.ModelConfig:
    """The model of ``cfg`` as it compiles for ``device`` (one of the mesh's; None: XLA's attention)."""
    m = cfg.model
    return model_lib.ModelConfig(
        **config_lib.model_fields(cfg),
        attention_impl=attention_impl(m.attention, m.compute_dtype, m.d_model // m.num_heads, device))


def attention_impl(attention: str, compute_dtype: str, head_dim: int, device=None) -> str | None:
    """``implementation=`` for ``jax.nn.dot_product_attention``. "auto": cuDNN's fused attention where it
    applies (an NVIDIA GPU of compute capability 8.0 or later, a 16-bit compute dtype, a head size that is
    a multiple of 8 up to 128), XLA's (None) anywhere else; "xla" and "cudnn" choose."""
    if attention != "auto":
        return None if attention == "xla" else attention
    capability = str(getattr(device, "compute_capability", "") or "0").split(".")[0]
    gpu = getattr(device, "platform", "cpu") in ("gpu", "cuda") and capability.isdigit() and int(capability) >= 8
    fits = compute_dtype in ("bfloat16", "float16") and head_dim % 8 == 0 and head_dim <= 128
    return "cudnn" if gpu and fits else None


def loss_and_grad(grad_fn, inputs, targets, accum_steps=1):
    """Mean loss and its gradient over ``inputs``, in ``accum_steps`` micro-batches of equal size.

    ``grad_fn(x, y) -> (loss, grads)`` (:func:`local_grad_fn`). The micro-batches' gradients are summed in
    fp32 (the first one starts the sum, so its type is the gradient's own) and divided by
    ``accum_steps``: the mean gradient of the whole batch.
    """
    if accum_steps == 1:
        return grad_fn(inputs, targets)
    xs, ys = (a.reshape((accum_steps, -1) + a.shape[1:]) for a in (inputs, targets))
    loss, grads = grad_fn(xs[0], ys[0])
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)

    def body(carry, xy):
        loss_sum, grad_sum = carry
        l, g = grad_fn(*coll.after(xy, carry))  # XLA:CPU: this micro-batch's collectives follow the last one's
        return (loss_sum + l, jax.tree.map(lambda a, b: a + b.astype(jnp.float32), grad_sum, g)), None

    (loss, grads), _ = lax.scan(body, (loss, grads), (xs[1:], ys[1:]))
    return loss / accum_steps, jax.tree.map(lambda g: g / accum_steps, grads)


def _per_layer(mcfg, params, shard_dims):
    """FSDP with scanned layers: the stack's shards are gathered one layer at a time inside the scan."""
    return shard_dims is not None and mcfg.scan_layers and "layers" in params


def _layer_gather(mcfg, shard_dims):
    """``layer_fn`` for the model: a layer's shards (its slice of the stack, so one dimension less) gathered
    in the compute dtype, plus ``delta`` (zeros whose cotangent is the layer's full local gradient)."""
    dims = jax.tree.map(lambda d: d - 1, shard_dims["layers"])

    def layer_fn(shards, delta):
        full = fsdp.gather(shards, dims, "data", dtype=mcfg.cdtype)
        if delta is None:
            return full
        # typed like the zeros (varying over data and replica), so the cotangent has their type
        return jax.tree.map(lambda f, z: _cotangent_to(specs.to_varying(f, specs.varying_axes(z)), z), full, delta)

    return layer_fn


@jax.custom_vjp
def _cotangent_to(full, zeros):
    """``full``, with its cotangent sent to ``zeros`` (same shape and dtype) instead of to ``full``'s inputs.

    The same gradient as ``full + zeros``, without the addition: XLA:CPU widened that bf16 add to fp32 and
    hoisted fp32 zeros of the whole stack out of the layer loop (7 GiB per MLP stack of the 8B recipe), and
    since ``zeros`` is never read here its broadcast is dropped altogether.
    """
    del zeros
    return full


def _cotangent_to_fwd(full, zeros):
    del zeros
    return full, None


def _cotangent_to_bwd(_, cotangent):
    return None, cotangent  # None: no cotangent for the gathered parameters (stop_gradient'd shards)


_cotangent_to.defvjp(_cotangent_to_fwd, _cotangent_to_bwd)


def local_grad_fn(mcfg, params, shard_dims=None):
    """``(x, y) -> (loss, full local gradient)`` for this step's ``params``, with no hidden psum.

    Replicated: the parameters cast to varying over the data axes (the README recipe). FSDP: the
    gathered parameters, gathered outside ``jax.grad`` (the transpose of a gather inside it would be an
    exact reduce-scatter that bypasses LoCo). With scanned layers the stack is gathered per layer
    inside the scan (only one layer is ever whole; remat gathers it again in the backward pass), and its
    full local gradient is the cotangent of zeros added to each gathered layer.
    """
    axes = _data_axes()
    loss = lambda p, x, y, **kw: model_lib.loss_fn(mcfg, p, x, y, **kw)
    if not _per_layer(mcfg, params, shard_dims):
        full = params if shard_dims is None else fsdp.gather(params, shard_dims, "data", dtype=mcfg.cdtype)
        varying = _varying(full, axes)
        return lambda x, y: jax.value_and_grad(loss)(varying, x, y)
    rest = {k: v for k, v in params.items() if k != "layers"}
    rest_full = _varying(fsdp.gather(rest, {k: shard_dims[k] for k in rest}, "data", dtype=mcfg.cdtype), axes)
    # XLA:CPU: the stack's gathers (in the scan) follow the rest's
    stack = coll.after(lax.stop_gradient(params["layers"]), rest_full)
    n = lax.axis_size("data")
    # typed like the stack itself (DiLoCo: varying over replica too), else the transpose would psum the
    # layers' gradient over the axes the zeros are invariant over
    stack_axes = set().union(*(specs.varying_axes(x) for x in jax.tree.leaves(stack)))
    delta_axes = tuple(a for a in specs.manual_axes() if a in axes or a in stack_axes)
    delta = _varying(jax.tree.map(lambda x, d: jnp.zeros(fsdp.full_shape(x.shape, d, n), mcfg.cdtype), stack,
                                  shard_dims["layers"]), delta_axes)
    layer_fn = _layer_gather(mcfg, shard_dims)

    def with_layers(rest_p, zeros, x, y):
        # XLA:CPU: the stack's gathers follow this micro-batch's inputs (and so the micro-batch before it)
        return loss(dict(rest_p, layers=coll.after(stack, x)), x, y, layer_fn=layer_fn, layer_extra=zeros)

    def grad_fn(x, y):
        value, (g_rest, g_layers) = jax.value_and_grad(with_layers, argnums=(0, 1))(rest_full, delta, x, y)
        return value, dict(g_rest, layers=g_layers)

    return grad_fn


def _varying(tree, axes):
    return lax.pcast(tree, axes, to="varying") if axes else tree  # outside shard_map: nothing to cast


def eval_loss(mcfg, params, inputs, targets, shard_dims=None):
    """The model's mean loss on ``params`` (replicated, or FSDP shards gathered as the train step does)."""
    if _per_layer(mcfg, params, shard_dims):
        rest = {k: v for k, v in params.items() if k != "layers"}
        full = dict(fsdp.gather(rest, {k: shard_dims[k] for k in rest}, "data", dtype=mcfg.cdtype),
                    layers=params["layers"])
        return model_lib.loss_fn(mcfg, full, inputs, targets, layer_fn=_layer_gather(mcfg, shard_dims))
    full = params if shard_dims is None else fsdp.gather(params, shard_dims, "data", dtype=mcfg.cdtype)
    return model_lib.loss_fn(mcfg, full, inputs, targets)


def train_step(tx, mcfg, params, opt_state, inputs, targets, *, phase=None, shard_dims=None, accum_steps=1,
               exchanger=None):
    """One step inside ``shard_map``: loss, gradient (no hidden psum), the optimizer, new params.

    ``exchanger``: LoCo's exchange runs in the backward pass, one bucket per layer
    (:func:`loco_jax.backward.value_and_exchanged_grad`; ``tx`` must hold that exchanger's ``compress``; the
    model's scanned stack, ``model.scan_layers``); None: after it.
    """
    extra = {} if phase is None else {"phase": phase}
    if exchanger is None:
        loss, grads = loss_and_grad(local_grad_fn(mcfg, params, shard_dims), inputs, targets, accum_steps)
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        # squares in the gradient's dtype, summed in fp32: no fp32 copy of a gradient-sized leaf is made
        grad_sq = sum(nonfinite.reduce_leaf(lambda x: jnp.sum(jnp.square(x), dtype=jnp.float32), g)
                      for g in jax.tree.leaves(grads))
        n = float(sum(g.size for g in jax.tree.leaves(grads)))  # a Python float: 8B values overflow int32
    else:
        loss, means, candidate, grad_sq = backward.value_and_exchanged_grad(
            lambda p, x, y, stack_fn: model_lib.loss_fn(mcfg, p, x, y, stack_fn=stack_fn), exchanger, params,
            loco.find_state(opt_state), inputs, targets, accum_steps=accum_steps, shard_dims=shard_dims,
            remat=mcfg.remat, cdtype=mcfg.cdtype, data_axes=_data_axes())
        updates, opt_state = tx.update(means, opt_state, params, exchanged=candidate, **extra)
        parts = 1 if shard_dims is None else lax.axis_size("data")
        n = float(sum(x.size for x in jax.tree.leaves(params))) * parts
    params = optax.apply_updates(params, updates)
    grad_rms = jnp.sqrt(grad_sq / n)  # this device's local gradient
    # XLA:CPU: the metrics' reduction follows every collective of the step (all feed params or opt_state)
    metrics = coll.after({"loss": loss, "grad_rms": grad_rms}, (params, opt_state))
    return params, opt_state, replica_metrics(metrics)


def replica_metrics(values: dict) -> dict:
    """Each value averaged over this replica's devices, one per replica (shape ``(1,)``, for an output spec
    ``P("replica")``): a step reduces its metrics inside the replica only, so a quiet step of Streaming
    DiLoCo sends nothing across replicas; the host averages the replicas' values when it reads them."""
    axes = specs.manual_axes()
    names = sorted(values)
    # one reduction of the stacked values: XLA:CPU orders it as one collective
    stacked = lax.pmean(specs.to_varying(jnp.stack([values[n] for n in names]), axes), _data_axes())
    return {name: stacked[i][None] for i, name in enumerate(names)}


def eval_step(mcfg, params, inputs, targets, *, shard_dims=None):
    """Mean loss over the eval batch, inside ``shard_map`` (params identical everywhere, or FSDP shards)."""
    return lax.pmean(eval_loss(mcfg, params, inputs, targets, shard_dims), specs.manual_axes())

