"""LoCo inside the backward pass: each layer's gradient is compressed and exchanged as soon as it exists.

:func:`loco_jax.loco.compress` is an optax transformation: it starts once ``jax.grad`` has returned the
whole gradient, so its collectives wait for the whole backward pass. Here the same per-bucket step
(:class:`loco_jax.loco.Exchanger`) runs *in* the backward pass of a scanned stack of layers, one bucket
per layer, so the exchange of layer ``l`` runs under the backward compute of layer ``l-1``. With the
same buckets (``compress(groups=...)``, one per layer of the stack) the two give the same means and
error buffers (to the bit where XLA:CPU rounds the two programs alike; tests/test_backward.py).

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

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from loco_jax import collectives as coll
from loco_jax import loco, specs


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
    if ex.error_bits is None:
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
    ``loco_jax.training.steps.loss_and_grad`` sums: ``g.astype(f32)``, then ``sum + g.astype(f32)``."""
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
