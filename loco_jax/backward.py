"""LoCo inside the backward pass: each layer's gradient is compressed and exchanged as soon as it exists.

:func:`loco_jax.loco.compress` is an optax transformation: it starts once ``jax.grad`` has returned the
whole gradient, so its collectives wait for the whole backward pass. Here the same per-bucket step
(:class:`loco_jax.loco.Exchanger`) runs *in* the backward pass of a scanned stack of layers, one bucket
per layer, so the exchange of layer ``l`` runs under the backward compute of layer ``l-1``. With the
same buckets (``compress(groups=...)``, one per layer of the stack) the two give the same means and
error buffers (to the bit where XLA:CPU rounds the two programs alike; tests/test_backward.py).

One entry point, :func:`value_and_exchanged_grad`: the model hands it its loss, which runs the scanned
stack through the ``stack_fn`` it is given, so the library never imports the model.

How: the stack's forward is a ``custom_vjp`` function ``run(h, p, e, s, ...)`` whose backward rule
receives the stack output's cotangent, runs the layers' backward itself, and returns::

    d/dp  = per layer, the LoCo mean of its local gradient g (reduce="mean") or this device's shard of it
    d/de  = per layer, the new error buffers          (e: the stored errors, passed in as an input)
    d/ds  = per layer, sum(g * g) on this device       (s: zeros; the local gradient's square norm)

so one ``jax.value_and_grad`` returns the means, the candidate error buffers and the square norms: the
pattern of flax's fp8 scales (``OVERWRITE_WITH_GRADIENT``), with the 8-bit error codes carried through
``float32`` cotangents as bit patterns (:func:`as_cotangent`; nothing adds or scales them on the way).
With micro-batches ``g`` is the last one's gradient added to the earlier ones' sum: ``(a + g) / n``.
Nothing is committed there: :func:`loco_jax.loco.compress`'s ``update(..., exchanged=...)`` decides the
non-finite rule on the means, once per step, and keeps the old state on a skipped step.

A scanned stack (:func:`stack`) gets its own backward loop, over ``l = L-2 ... 0``: the all-to-all of
layer ``l+1``'s payload (quantized at the end of the previous iteration) is issued at the top, layer
``l``'s forward is recomputed from its saved input (as ``remat`` does) with its parameters prepared one
iteration ahead (FSDP: all-gathered), its vector-Jacobian product taken, and only then (an
``optimization_barrier`` on the received payload and the new gradient) is layer ``l+1``'s exchange
finished and layer ``l``'s payload made. So each iteration's collectives run under a whole layer's
backward compute: a collective issued and finished inside one iteration could overlap only what the
scheduler chose to put beside it. Layer ``L-1``'s product is taken before the loop and layer 0's
exchange finished after it; outputs and new errors are written in place into ``(L, ...)`` buffers.

Micro-batches: compressing once per step needs the sum of every micro-batch, so only the last one's
backward pass carries the exchange. The earlier ones add each bucket's gradient into the fp32 sum as
their backward pass produces it (:func:`accumulate_group`, :func:`accumulate_stack`: the sum is an input
whose cotangent is the sum with the gradient added), so no micro-batch's whole gradient exists at once;
the sum itself, full-size on every device, does.

What it costs and excludes: under ``remat`` the stack's forward is recomputed in the backward pass (as
``jax.checkpoint`` does), else each layer's residuals are saved (as a plain scan does); the new error
buffers and the outputs exist beside the old state until the step is decided (the non-finite rule keeps
the old state on a skipped step); the leaves outside the stack (embedding, head) are exchanged after
the backward pass (the trainer does; XLA would not overlap them with the layer loop anyway); the
hierarchical ``fast_axis`` all-reduce is not supported. Unrolled layers are not: exchanged from
per-layer ``custom_vjp`` uses, the compiler placed their quantization after the backward pass anyway
and kept many buckets' working copies at once (docs/results.md), and XLA:CPU, which runs independent
collectives in no fixed order, could deadlock on them.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from loco_jax import collectives as coll
from loco_jax import fsdp, loco, specs

STACK = "layers"  # the key of the scanned stack of layers in the parameter tree


def _varying(tree, axes):
    return lax.pcast(tree, axes, to="varying") if axes else tree  # outside shard_map: nothing to cast


def as_cotangent(slot):
    """A bucket's error buffers as float32 arrays (uint8 codes bit-cast four to a value), so that they can
    travel as cotangents. Inverse: :func:`from_views`."""
    def one(x):
        if x is None or x.dtype != jnp.uint8:
            return x
        return lax.bitcast_convert_type(x.reshape(x.shape[:-1] + (x.shape[-1] // 4, 4)), jnp.float32)
    return tuple(one(x) for x in slot)


def from_views(ex: loco.Exchanger, slot_f):
    """The stored error buffers from their cotangent views (:func:`as_cotangent`'s inverse)."""
    if ex.codec.error_bits is None:  # stored in fp32 (or nothing stored): the views are the buffers
        return tuple(slot_f)
    codes = lambda x: None if x is None else lax.bitcast_convert_type(x, jnp.uint8).reshape(x.shape[:-1] + (-1,))
    values, scales, values2, scales2 = slot_f
    return codes(values), scales, codes(values2), scales2


def accumulate(grads, acc, count):
    """The last micro-batch's gradients with the earlier ones' sum, as a mean: ``(sum + g) / n``, or ``g``."""
    if acc is None:
        return grads
    return [x / count for x in _sum_into(acc, grads, False)]


def square_norm(grads):
    return sum(jnp.sum(jnp.square(g), dtype=jnp.float32) for g in grads)


def _typed_like(x, ref):
    """``x`` cast to varying over every axis ``ref`` varies over (a cotangent must have its primal's type)."""
    return specs.to_varying(x, specs.varying_axes(ref))


def _index(tree, i):
    return jax.tree.map(lambda x: lax.dynamic_index_in_dim(x, i, keepdims=False), tree)


def _stack_forward(layer, prepare, remat, h, params, consts):
    """The stack's forward scan: ``(output, saved)``, ``saved`` each layer's input (remat) or its ``jax.vjp``
    residuals."""
    def body(c, p):
        if remat:
            return layer(prepare(p), c, *consts), c
        return jax.vjp(lambda f, x: layer(f, x, *consts), prepare(p), c)  # (output, its residuals)
    return lax.scan(body, h, params)


def _layer_vjp(layer, prepare, params, saved, consts, remat, i, ct, full=None):
    """Layer ``i``'s vector-Jacobian product in a stack's backward loop: ``(its full local gradient leaves, the
    cotangent of its input)``. ``saved``: each layer's input (remat: the layer is recomputed from it, with
    ``full``, its prepared parameters, when given) or its ``jax.vjp`` residuals."""
    if remat:
        full = prepare(_index(params, i)) if full is None else full
        _, vjp = jax.vjp(lambda f, c: layer(f, c, *consts), full, _index(saved, i))
    else:
        vjp = _index(saved, i)
    g_full, ct_in = vjp(ct)
    return jax.tree.leaves(g_full), ct_in


def stack(ex: loco.Exchanger, base: int, prepare: Callable, dims, count: int, layer: Callable, *,
          remat: bool = True):
    """The scanned stack with its exchange in the backward pass:
    ``run(h, params, slot_f, sq, acc, inputs, consts) -> h_out``.

    ``layer(full_params, h, *consts) -> h`` is one layer (it must close over no traced value: pass them in
    ``consts``); ``prepare`` maps a layer's slice of ``params`` (shards or replicated parameters) to its
    full parameters; ``dims``: the layer slices' shard dimensions (scatter) or None. ``params``, ``acc``
    (or None) and the slot views (``(L, M, cols)``) have the layer axis first; layer ``l`` is bucket
    ``base + l``. ``sq`` has shape ``(L,)``. Cotangents, per layer: the LoCo mean (or shard) for ``params``,
    the new error buffers for ``slot_f``, ``sum(g^2)`` for ``sq`` (module docstring). ``remat``: the
    forward pass saves only each layer's input and the backward pass recomputes the layer; False: it saves
    each layer's residuals (its ``jax.vjp``), as a scan without ``jax.checkpoint`` does.
    """

    @jax.custom_vjp
    def run(h, params, slot_f, sq, acc, inputs, consts):
        del slot_f, sq, acc, inputs
        return _stack_forward(layer, prepare, True, h, params, consts)[0]

    def fwd(h, params, slot_f, sq, acc, inputs, consts):
        out, saved = _stack_forward(layer, prepare, remat, h, params, consts)
        return out, (saved, params, slot_f, sq, acc, inputs, consts)

    def bwd(res, ct_out):
        saved, params, slot_f, sq, acc, inputs, consts = res
        depth = jax.tree.leaves(params)[0].shape[0]
        # XLA:CPU: the top layer's gather (FSDP under remat) follows the forward pass (the cotangent)
        top = prepare(coll.after(_index(params, depth - 1), ct_out)) if remat else None
        pending, ct = _layer_vjp(layer, prepare, params, saved, consts, remat, depth - 1, ct_out, top)
        noise_axes = loco.state_axes(pending, ex.axis_name)  # the layers' gradients all vary alike
        walk = _BackwardWalk(ex, base, prepare, dims, count, layer, remat, params, saved, consts, acc, slot_f,
                             inputs, noise_axes)
        zeros = lambda ref: _typed_like(jnp.zeros(ref.shape, ref.dtype), ref)
        bufs = (jax.tree.map(zeros, params), tuple(None if x is None else zeros(x) for x in slot_f), zeros(sq))
        run_loop = walk.pipelined if ex.pipelined else walk.sequential
        ct, (out_buf, slot_buf, sq_buf) = run_loop(ct, pending, bufs, depth)
        return ct, out_buf, slot_buf, sq_buf, None, None, jax.tree.map(jnp.zeros_like, consts)

    run.defvjp(fwd, bwd)
    return run


class _BackwardWalk(NamedTuple):
    """One backward pass of :func:`stack`'s layers, top down, with each layer's bucket step (module
    docstring): what the loop needs, and its pieces. ``bufs`` is ``(outputs, error buffers, square norms)``,
    each ``(L, ...)``, written in place, layer ``i`` at index ``i``; layer ``i`` is bucket ``base + i``."""
    ex: loco.Exchanger
    base: int
    prepare: Callable
    dims: object
    count: int
    layer: Callable
    remat: bool
    params: object
    saved: object
    consts: tuple
    acc: object
    slot_f: tuple
    inputs: object
    noise_axes: tuple

    def backward(self, i, ct, full=None):
        return _layer_vjp(self.layer, self.prepare, self.params, self.saved, self.consts, self.remat, i, ct, full)

    def local(self, i, grads):
        """Layer i's local gradient leaves: with micro-batches, the mean of the earlier ones' sum and these."""
        return accumulate(grads, None if self.acc is None else jax.tree.leaves(_index(self.acc, i)), self.count)

    def stored_slot(self, i):
        return from_views(self.ex, _index(self.slot_f, i))

    @staticmethod
    def write(bufs, i, outs=None, slot=None, sq_value=None):
        """``bufs`` with layer i's outputs, error buffers (None entries: unchanged) and square norm written."""
        out_buf, slot_buf, sq_buf = bufs
        if outs is not None:
            leaves = [lax.dynamic_update_index_in_dim(buf, o.astype(buf.dtype), i, 0)
                      for buf, o in zip(jax.tree.leaves(out_buf), outs)]
            out_buf = jax.tree.unflatten(jax.tree.structure(out_buf), leaves)
        if slot is not None:
            slot_buf = tuple(buf if buf is None or v is None else
                             lax.dynamic_update_index_in_dim(buf, _typed_like(v, buf), i, 0)
                             for buf, v in zip(slot_buf, as_cotangent(slot)))
        if sq_value is not None:
            sq_buf = lax.dynamic_update_index_in_dim(sq_buf, _typed_like(sq_value, sq_buf)[None], i, 0)
        return out_buf, slot_buf, sq_buf

    def exchange(self, i, grads, bufs):
        """Layer i's whole bucket step, written into the output buffers."""
        grads = self.local(i, grads)
        axes = loco.state_axes(grads, self.ex.axis_name)
        outs, slot = self.ex.bucket(self.base + i, grads, self.dims, self.stored_slot(i), self.inputs, axes)
        return self.write(bufs, i, outs, slot, square_norm(grads))

    def send(self, i, grads, bufs):
        """Layer i up to its all-to-all: ``(payload, layout, bufs)`` with its new stage-1 error written."""
        grads = self.local(i, grads)
        payload, layout, slot = self.ex.send(self.base + i, grads, self.dims, self.stored_slot(i), self.inputs,
                                             self.noise_axes)
        return payload, layout, self.write(bufs, i, slot=slot[:2] + (None, None), sq_value=square_norm(grads))

    def receive(self, i, received, layout, bufs):
        """Layer i from its received payloads: its output and, where kept, its second-stage error."""
        outs, slot = self.ex.receive(self.base + i, received, layout, self.stored_slot(i), self.inputs,
                                     self.noise_axes)
        return self.write(bufs, i, outs, (None, None) + tuple(slot[2:]))

    def sequential(self, ct, pending, bufs, depth):
        """Each iteration exchanges the layer above whole, beside this layer's backward compute:
        ``(input cotangent, bufs)``. ``pending``: the top layer's gradient leaves, taken before the loop."""
        def body(carry, i):
            ct, pending, bufs = carry
            bufs = self.exchange(i + 1, pending, bufs)
            # XLA:CPU: layer i's gather (FSDP under remat) and the next exchange follow this one
            done = _index(bufs[0], i + 1)
            full = self.prepare(coll.after(_index(self.params, i), done)) if self.remat else None
            pending, ct = self.backward(i, ct, full)
            pending = coll.after(pending, done)
            return (ct, pending, bufs), None

        (ct, pending, bufs), _ = lax.scan(body, (ct, pending, bufs), _layers_below_top(depth))
        return ct, self.exchange(jnp.int32(0), pending, bufs)

    def pipelined(self, ct, pending, bufs, depth):
        """The all-to-all of layer i+1 (its payload carried from the previous iteration) is issued at the top
        of iteration i and its result used only once layer i's gradient exists, so it runs under layer i's
        backward compute; layer i's payload is made at the end, for the next iteration. Under remat, layer
        i's parameters are prepared (FSDP: all-gathered) one iteration ahead, so that gather too runs under
        compute (the last iteration prepares layer 0 again, unused)."""
        payload, layout, bufs = self.send(depth - 1, pending, bufs)
        # XLA:CPU runs independent collectives in no fixed order: each gather follows the gather and the
        # exchange before it (the top layer's gather is taken before the loop), each exchange the gather
        # issued beside it
        ahead = self.prepare(coll.after(_index(self.params, depth - 2), pending)) if self.remat else None

        def body(carry, i):
            ct, payload, bufs, full = carry
            full_next = (self.prepare(coll.after(_index(self.params, jnp.maximum(i - 1, 0)), (full, payload)))
                         if self.remat else None)
            if full_next is not None:
                payload = coll.after(payload, full_next)
            received = self.ex.exchange(payload)
            grads, ct = self.backward(i, ct, full)
            received, grads = lax.optimization_barrier((received, grads))
            bufs = self.receive(i + 1, received, layout, bufs)
            # XLA:CPU: the next exchange follows this one's result (the barrier does not order them there)
            grads = coll.after(grads, _index(bufs[0], i + 1))
            payload, _, bufs = self.send(i, grads, bufs)
            return (ct, payload, bufs, full_next), None

        (ct, payload, bufs, _), _ = lax.scan(body, (ct, payload, bufs, ahead), _layers_below_top(depth))
        return ct, self.receive(jnp.int32(0), self.ex.exchange(payload), layout, bufs)


def _layers_below_top(depth):
    """The loop's layer indices, top down: ``L-2, ..., 0`` (layer ``L-1``'s product is taken before it)."""
    return jnp.arange(depth - 2, -1, -1, dtype=jnp.int32)


def _sum_into(acc, grads, first):
    """The micro-batches' fp32 sum with these gradients added (``first``: the sum starts at them), as
    ``loco_jax.training.run.steps.loss_and_grad`` sums: ``g.astype(f32)``, then ``sum + g.astype(f32)``."""
    if first:
        return [g.astype(jnp.float32) for g in grads]
    return [a + g.astype(jnp.float32) for a, g in zip(acc, grads)]


def accumulate_group(prepare: Callable, first: bool):
    """An earlier micro-batch's use of a group of leaves: ``use(leaves, acc) -> prepare(leaves)``, whose
    cotangent for ``acc`` (the group's fp32 sum so far; ignored when ``first``) is the sum with this
    micro-batch's gradient added. The gradient of ``leaves`` itself is not wanted (not differentiated)."""

    @jax.custom_vjp
    def use(leaves, acc):
        del acc
        return prepare(leaves)

    def fwd(leaves, acc):
        return prepare(leaves), acc

    def bwd(acc, ct):
        return None, [_typed_like(x, a) for x, a in zip(_sum_into(acc, list(ct), first), acc)]

    use.defvjp(fwd, bwd)
    return use


def accumulate_stack(prepare: Callable, layer: Callable, first: bool, *, remat: bool = True):
    """An earlier micro-batch through the scanned stack: ``run(h, params, acc, consts) -> h_out``, whose
    cotangent for ``acc`` (the stack's fp32 sum so far, layer axis first) has each layer's gradient added
    as the backward pass produces it, in place, so that no micro-batch's whole gradient exists at once.
    ``prepare``, ``layer``, ``remat``: as for :func:`stack`."""

    @jax.custom_vjp
    def run(h, params, acc, consts):
        del acc
        return _stack_forward(layer, prepare, True, h, params, consts)[0]

    def fwd(h, params, acc, consts):
        out, saved = _stack_forward(layer, prepare, remat, h, params, consts)
        return out, (saved, params, acc, consts)

    def bwd(res, ct_out):
        saved, params, acc, consts = res

        def body(carry, i):
            ct, acc_buf = carry
            g_full, ct = _layer_vjp(layer, prepare, params, saved, consts, remat, i, ct)
            sums = _sum_into(jax.tree.leaves(_index(acc_buf, i)), g_full, first)
            leaves = [lax.dynamic_update_index_in_dim(buf, _typed_like(x, buf), i, 0)
                      for buf, x in zip(jax.tree.leaves(acc_buf), sums)]
            return (ct, jax.tree.unflatten(jax.tree.structure(acc_buf), leaves)), None

        depth = jax.tree.leaves(params)[0].shape[0]
        (ct, acc_out), _ = lax.scan(body, (ct_out, acc), jnp.arange(depth - 1, -1, -1, dtype=jnp.int32))
        return ct, None, acc_out, jax.tree.map(jnp.zeros_like, consts)

    run.defvjp(fwd, bwd)
    return run


class _Buckets(NamedTuple):
    """The parameter tree as the in-backward exchange sees it: its leaves, their bucket groups outside the
    stack (``members_of[b]``: the leaves of bucket ``b``) and the stack's leaves, with the shard dimensions
    and full shapes FSDP needs."""

    leaves: list
    treedef: Any
    dims: list
    full_shapes: list
    flat: list
    stack: tuple
    scatter: bool
    cdtype: Any
    axes: tuple
    layer_dims: Any
    layer_tree: Any
    members_of: list  # per bucket outside the stack, its leaves' indices
    dims_of: list  # per bucket outside the stack, its leaves' shard dimensions (FSDP), else None

    def gathered(self, xs, xdims):
        """A group's (or a layer's) full parameters for the model: cast to varying, or all-gathered (FSDP)."""
        if not self.scatter:
            return _varying(xs, self.axes)
        return _varying(fsdp.gather(xs, xdims, "data", dtype=self.cdtype), self.axes)

    def stack_part(self, tree_leaves):
        """The stack's entries of a per-leaf list, as the stack's tree."""
        return jax.tree.unflatten(self.layer_tree, [tree_leaves[i] for i in self.stack[0]])


def _buckets(ex: loco.Exchanger, params, shard_dims, cdtype, data_axes) -> _Buckets:
    leaves, treedef = jax.tree.flatten(params)
    labels = ex.labels_of(treedef, len(leaves))
    if any(label is None for label in labels):
        raise ValueError("the in-backward exchange needs every parameter in a bucket group (loco.compress(groups=)).")
    if STACK not in params:
        raise ValueError(f"the in-backward exchange runs in a scanned stack's backward loop: it needs the "
                         f"stacked layers under params[{STACK!r}] (a scanned model).")
    n = lax.axis_size("data")
    dims = jax.tree.leaves(shard_dims) if shard_dims is not None else [0] * len(leaves)
    full_shapes = [fsdp.full_shape(x.shape, d, n) if shard_dims is not None else tuple(x.shape)
                   for x, d in zip(leaves, dims)]
    flat, stack = ex.layout(full_shapes, dims, labels, n)
    scatter = shard_dims is not None
    layer_dims = jax.tree.map(lambda d: d - 1, shard_dims[STACK]) if scatter else None
    members_of = [[i for i, _, _ in members] for members, _ in flat]
    dims_of = [[dims[i] for i in idx] if scatter else None for idx in members_of]
    return _Buckets(leaves, treedef, dims, full_shapes, flat, stack, scatter, cdtype, data_axes, layer_dims,
                    jax.tree.structure(params[STACK]), members_of, dims_of)


def _earlier_micro_batches(loss_fn, bk: _Buckets, xs, ys, remat):
    """The first ``n - 1`` micro-batches: ``(loss sum, fp32 gradient sums)``, each bucket's gradient added as
    the backward pass produces it (:func:`accumulate_group` and
    :func:`accumulate_stack`), so no micro-batch's whole gradient exists at once."""
    members_of, dims_of = bk.members_of, bk.dims_of

    def summed(x, y, acc, first):
        def loss(acc):
            used = list(bk.leaves)
            # XLA:CPU: each group's gathers (FSDP) follow the one before, the first the micro-batch before
            # (its sums), and the stack's (in its loops) follow them all
            previous = [] if first else acc
            for b, idx in enumerate(members_of):
                use = accumulate_group(lambda xs, d=dims_of[b]: bk.gathered(xs, d), first)
                previous = use(coll.after([used[i] for i in idx], previous), [acc[i] for i in idx])
                for i, full in zip(idx, previous):
                    used[i] = full
            for i, leaf in zip(bk.stack[0], coll.after([used[i] for i in bk.stack[0]], previous)):
                used[i] = leaf

            def stack_fn(layer, h, stack_params, consts):
                run = accumulate_stack(lambda p: bk.gathered(p, bk.layer_dims), layer, first, remat=remat)
                return run(h, stack_params, bk.stack_part(acc), consts)

            return loss_fn(jax.tree.unflatten(bk.treedef, used), x, y, stack_fn)

        return jax.value_and_grad(loss)(acc)

    # the sums vary over the data axes and over every axis the parameters vary over (DiLoCo's replica)
    vary = set(bk.axes).union(*(specs.varying_axes(x) for x in bk.leaves))
    zeros = [specs.to_varying(jnp.zeros(shape, jnp.float32), tuple(a for a in specs.manual_axes() if a in vary))
             for shape in bk.full_shapes]
    loss_sum, acc = summed(xs[0], ys[0], zeros, True)

    def body(carry, xy):
        loss_sum, acc = carry
        value, acc = summed(*xy, acc, False)
        return (loss_sum + value, acc), None

    if len(xs) > 2:
        (loss_sum, acc), _ = lax.scan(body, (loss_sum, acc), (xs[1:-1], ys[1:-1]))
    return loss_sum, acc


def _exchange_after_backward(ex, bk: _Buckets, local, acc, accum_steps, loco_state, step, after):
    """The groups outside the stack (embedding, head), exchanged after the backward pass with the same bucket
    step as ``compress``: ``(means per leaf index, their new slots, their gradients' square norms)``. XLA
    does not overlap a collective with a loop that holds collectives, and XLA:CPU, which runs independent
    collectives in no fixed order, would race them with the stack's: they follow ``after``."""
    means, slots, squares, previous = {}, [], [], after
    axes_of = loco.state_axes(local[0], ex.axis_name) if local else ()
    for b, idx in enumerate(bk.members_of):
        grads = accumulate(local[b], None if acc is None else [acc[i] for i in idx], accum_steps)
        grads = coll.after(grads, previous)  # XLA:CPU: one exchange at a time, after the stack's
        outs, slot = ex.bucket(b, grads, bk.dims_of[b], ex.slot_of(loco_state, b), step, axes_of)
        means.update(zip(idx, outs))
        slots.append(slot)
        squares.append(square_norm(grads))
        previous = outs
    return means, slots, squares


def value_and_exchanged_grad(loss_fn: Callable, ex: loco.Exchanger, params, loco_state, inputs, targets, *,
                             accum_steps: int = 1, shard_dims=None, remat: bool = True, cdtype=jnp.float32,
                             data_axes: tuple = ("data",)):
    """Mean loss, the exchanged mean gradient, LoCo's candidate state and the local gradient's square norm,
    with each bucket exchanged in the backward pass: this module's one entry point.

    ``loss_fn(params, inputs, targets, stack_fn)``: the model's mean loss, which runs its scanned stack of
    layers (``params[STACK]``, stacked on dim 0) as ``stack_fn(layer, h, stack_params, consts)`` with
    ``layer(layer_params, h, consts) -> h``; the model hands its own, so this module never imports it.
    ``ex``: the exchanger of the step's ``loco.compress``, built with ``groups=`` (one bucket per layer of
    the stack, :data:`loco_jax.loco.STACK`); ``loco_state``: its current state. ``shard_dims``: FSDP's
    (:func:`loco_jax.fsdp.shard_dims`), the parameters gathered in ``cdtype``; ``data_axes``: the bound axes
    of one replica's devices, over which the parameters are cast to varying before the gradient;
    ``remat``: the stack's forward recomputed in its backward pass. The first ``accum_steps - 1`` micro-batches are summed locally in fp32
    as :func:`loss_and_grad` sums them, each bucket's gradient added in the backward pass as it is produced
    (no micro-batch's whole gradient exists at once); the last one's backward pass adds each bucket's sum
    and exchanges it (``(sum + g) / accum_steps``): the same numbers as ``loss_and_grad`` followed by
    ``compress``.
    Returns ``(loss, means, candidate, grad_sq)``: ``means`` shaped like ``params`` (FSDP: shards),
    ``candidate`` a :class:`loco_jax.loco.CompressState` holding the new error buffers (for
    ``update(..., exchanged=candidate)``, which decides and commits).
    """
    bk = _buckets(ex, params, shard_dims, cdtype, data_axes)
    loss_sum, acc = None, None
    if accum_steps > 1:
        xs, ys = (a.reshape((accum_steps, -1) + a.shape[1:]) for a in (inputs, targets))
        loss_sum, acc = _earlier_micro_batches(loss_fn, bk, xs, ys, remat)
        inputs, targets = xs[-1], ys[-1]
    step = ex.step_inputs(loco_state)

    # the groups outside the stack take their whole local gradient from the backward pass (prepared: their
    # full parameters as the model uses them); the stack's error buffers travel as cotangents
    prepared = []
    for b, idx in enumerate(bk.members_of):  # XLA:CPU: each group's gathers (FSDP) after the one before
        before = prepared[-1:] or (acc or [])  # the first after the earlier micro-batches' sums
        prepared.append(bk.gathered(coll.after([bk.leaves[i] for i in idx], before), bk.dims_of[b]))
    stack_params = coll.after(params[STACK], prepared)  # and the stack's (in its loops) after them all
    base = len(bk.flat)  # the stack's first bucket number
    stack_view = as_cotangent(ex.slot_of(loco_state, base))
    stack_sq = specs.to_varying(jnp.zeros((bk.stack[1],), jnp.float32), specs.manual_axes())
    layer_acc = None if acc is None else bk.stack_part(acc)
    run_dims = [bk.dims[i] - 1 for i in bk.stack[0]] if bk.scatter else None

    def loss(stack_params, prepared, stack_view, stack_sq):
        used = list(bk.leaves)
        for idx, fulls in zip(bk.members_of, prepared):
            for i, full in zip(idx, fulls):
                used[i] = full
        used = jax.tree.unflatten(bk.treedef, used)
        used[STACK] = stack_params

        def stack_fn(layer, x, stack_params, consts):
            run = stack(ex, base, lambda p: bk.gathered(p, bk.layer_dims), run_dims, accum_steps, layer, remat=remat)
            return run(x, stack_params, stack_view, stack_sq, layer_acc, step, consts)

        return loss_fn(used, inputs, targets, stack_fn)

    value, (stack_means, local, stack_view, stack_sq) = jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(
        stack_params, prepared, stack_view, stack_sq)
    if loss_sum is not None:
        value = (loss_sum + value) / accum_steps
    mean_leaves = [None] * len(bk.leaves)
    for i, mean in zip(bk.stack[0], jax.tree.leaves(stack_means)):
        mean_leaves[i] = mean
    means, slots, squares = _exchange_after_backward(ex, bk, local, acc, accum_steps, loco_state, step,
                                                     jax.tree.leaves(stack_means))
    for i, mean in means.items():
        mean_leaves[i] = mean
    slots.append(from_views(ex, stack_view))
    grad_sq = sum([jnp.sum(stack_sq)] + squares)  # the stack's first: the order the sum was always taken in
    return value, jax.tree.unflatten(bk.treedef, mean_leaves), loco_state._replace(**loco.stored(slots)), grad_sq
