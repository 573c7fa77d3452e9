"""DiLoCo and Streaming DiLoCo: an outer optimizer on the ``replica`` mesh axis.

``M`` replicas on ``axis_name`` (default ``"replica"``) train alone with the
inner optimizer and meet every ``H = sync_every`` steps, one *fragment* of the
model at a time (:mod:`loco_jax.fragments`)::

    after inner step t, fragment p is due when t >= H and (t - t_p) % H == 0,
    t_p = floor(p * H / P)                             (p = 0 .. P-1, P <= H)

    Delta_p   = theta_global_p - theta_p(t)            # outer gradient, this replica
    Delta_p   = mean over replicas of Delta_p          # exchanged during steps t+1 .. t+tau
    after step t + tau:
      theta~_p       = OuterOpt_p(theta_global_p, Delta_p)
      theta_p        = alpha * theta_p(t + tau) + (1 - alpha) * theta~_p
      theta_global_p = theta~_p

(A sparse exchange with ``keep_unsent`` restarts each replica from ``theta~_p - beta e_p +
theta_p(t + tau) - theta_p(t)`` instead: ``exchange.Sparse.of(density, keep_unsent=True)``.)
``P = 1, tau = 0, alpha = 0`` is vanilla DiLoCo (Douillard et al. 2023);
``P > 1`` with overlap ``tau >= 1`` is Streaming DiLoCo (Douillard et al.
2025, arXiv 2501.18512). Fragment 0 holds every leaf outside the transformer
blocks; the blocks are strided over fragments 1..P-1. Each fragment has its
own outer optimizer state (default SGD, lr 0.7, Nesterov momentum 0.9),
initialised on its own sub-tree and stepped only when it syncs. The step
count ``t`` counts completed inner steps; the first ``update`` is ``t = 1``.

**Exchange.** All data devices of a replica hold the same parameters, so each
takes its own 1/D slice of the fragment's flat outer gradient, only that
slice crosses ``replica``, and the reduced slices are all-gathered over
``data_axis`` inside the replica: as the exchanged codes (the M payloads of
each slice, decoded on every device: the same values, bit for bit) where
those are fewer bytes than fp32 (``M x bits < 32``, ``GATHER_CODES_BELOW``),
else as fp32 slices (and always when ``tau >= 2`` keeps the mean in the
state). On GPUs the exchange across replicas is hinted onto a collective
stream of its own (:func:`loco_jax.collectives.on_own_stream`). ``bits=None`` is an exact fp32 mean; 8, 4
(``int`` or ``e3m0``), 2 and 1 bits send packed ``uint8`` payloads and sum in
fp32. The default ``mode="all_gather"`` quantizes once (each replica's own
outer gradient, as the paper does): with the few replicas DiLoCo runs (2-8) it
costs the same bytes as the two-stage form at M = 2 and at most
(M-1)/(2(M-1)/M) = M/2 times more above, and it adds no second rounding.
``codec(b, compensate=True)`` keeps a LoCo error buffer per fragment, carried from one
sync of that fragment to the next (``e = beta e + (1 - beta)(h - DQ(Q(h)))``,
``h = Delta + e``, stored in ``error_bits``): new in this project.

**Overlap in SPMD.** A collective cannot outlive the compiled program that
issued it, so "send at t, use at t + tau" is built from collectives whose
operands do not depend on the step's gradients. With ``tau >= 1`` the
snapshot ``theta_p(t)`` is exactly the ``params`` that step ``t + 1``
receives, so the exchange is issued in step ``t + 1``'s program on
``theta_global_p - params_p``: it has no data path from that step's forward
and backward pass, and the latency-hiding scheduler may run it alongside.
With ``tau = 1`` the result is applied at the end of the same program; with
``tau >= 2`` it waits in the state (``inflight``) and is applied after step
``t + tau``. ``tau = 0`` exchanges after the inner step of ``t`` itself (no
overlap). At most one fragment is in flight (``tau < floor(H / P)``).

Two ways to run it:

- static (the trainer's): ``phase = tx.phase(t)`` in Python, then
  ``tx.update(grads, state, params, phase=phase)`` builds only that phase's
  collectives; compile one program per distinct phase (``tx.phases()``,
  about P + 1) and pick it in the Python loop. Every collective is static and
  free to overlap.
- traced fallback (one-liners, tests): without ``phase``, a ``lax.switch`` on
  the traced step picks the phase. Same numbers, but the collectives sit
  inside control flow, which blocks XLA's latency-hiding scheduler: use it
  where overlap does not matter.

Non-finite values: replicas decide alone between syncs, and together at
the exchange. The inner optimizer's ``update`` is passed the replica axis as
``independent_axes`` (:mod:`loco_jax.nonfinite`), so its finite flag
(over the step's gradients and inner updates, and any flag the inner
optimizer takes, e.g. :func:`loco_jax.loco.compress`'s) is reduced over one
replica's devices only: a replica with a NaN or Inf skips its own inner step
(its local parameters and inner state unchanged, its ``skipped`` count up by
one) and the others go on; nothing crosses ``replica`` for it. The outer side
decides from the exchanged mean itself: every replica decodes the same
payloads, and a non-finite outer gradient on any replica makes its blocks of
the mean non-finite (a NaN or Inf scale decodes to NaN), so a flag over one
replica's slices of the mean is the same on every replica with no extra
collective. A non-finite mean drops that fragment's round: ``dropped`` counts
it, the error buffers keep their values, the in-flight slot is marked empty
(NaN) with ``overlap >= 2``, and the apply leaves the fragment's global
parameters, outer state and local parameters as they are (the rest of the
step runs normally). The fragment syncs again ``H`` steps later. The schedule
is a clock: ``step`` advances on every step, skipped or not, so the phase of
step ``t`` is always ``phase(t)`` and a training loop picks it from its own
step count without reading the device.

State layout (:func:`state_specs`): the inner state and the local
parameters differ per replica, global parameters and outer states are
identical everywhere, error buffers and the in-flight slice differ per
device.

Why one module of this size: the schedule, the exchange (:class:`Exchange`), the apply (:func:`merge`)
and the in-flight relayout are DiLoCo's parts, each a module-level piece; the factory only wires them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from loco_jax import collectives as coll
from loco_jax import exchange as exchange_lib
from loco_jax import fragments as frag
from loco_jax import quant, specs
from loco_jax import sparse as sparse_lib
from loco_jax.checks import is_int, require_int
from loco_jax.nonfinite import INDEPENDENT, all_finite, decision_axes, select

MODES = coll.MODES


class Phase(NamedTuple):
    """What one step does besides the inner step.

    ``send``: fragment whose outer gradient is exchanged in this step's
    program (None: none). ``apply``: fragment whose merged value is applied
    at the end of this step. With overlap 0 or 1 a syncing step has
    ``send == apply``; with overlap >= 2 they fall on different steps.
    """

    send: int | None = None
    apply: int | None = None


class DiLoCoState(NamedTuple):
    inner: Any  # inner optimizer state, per replica (its scalars stored as shape (1,): [M] in the global view)
    global_params: Any  # theta_global, identical on every device
    outer: tuple  # one outer optimizer state per fragment
    step: jax.Array  # int32 []: completed inner steps (skipped ones too: the schedule's clock)
    skipped: jax.Array  # int32 [1] per replica ([M] in the global view): this replica's skipped inner steps
    inflight: jax.Array  # f32 [k_max]: reduced outer-gradient slice waiting to be applied ([1] placeholder when overlap < 2)
    error: tuple = ()  # per fragment: stored outer-gradient error of this device's slice (compensate=True)
    error_scale: tuple = ()
    dropped: jax.Array | None = None  # int32 []: rounds dropped for a non-finite exchanged mean (init sets it)
    outbox: jax.Array | None = None  # islands (as_islands): uint8 [bytes]: this device's payload of the last send


# The apply step gathers a fragment's mean inside the replica as the exchanged codes (M payloads of a
# slice) when they take fewer bytes than this many per value (fp32: 4), else as fp32 slices.
GATHER_CODES_BELOW = 4
APPLY_GATHER = "diloco_apply_gather"


def schedule_offsets(sync_every, num_fragments):
    """``t_p = floor(p * H / P)`` for every fragment."""
    return tuple(p * sync_every // num_fragments for p in range(num_fragments))


def due_fragment(step, *, sync_every, num_fragments):
    """The fragment due after inner step ``step`` (a Python int), or None."""
    if step < sync_every:
        return None
    for p, t_p in enumerate(schedule_offsets(sync_every, num_fragments)):
        if (step - t_p) % sync_every == 0:
            return p
    return None


def phase(step, *, sync_every, num_fragments=1, overlap=0):
    """The :class:`Phase` of inner step ``step`` (1-based, a Python int)."""
    due = functools.partial(due_fragment, sync_every=sync_every, num_fragments=num_fragments)
    if overlap == 0:
        p = due(step)
        return Phase(p, p)
    send = due(step - 1)
    apply = due(step - overlap)
    return Phase(send, apply)


def island_phase(step, *, sync_every, num_fragments=1, overlap=1):
    """The :class:`Phase` of inner step ``step`` for islands (:func:`as_islands`): fragment ``p`` due after
    step ``t`` is encoded at the end of step ``t``'s program (from ``theta(t)``, the snapshot the mesh mode
    sends in step ``t + 1``'s) and applied at the end of step ``t + tau``'s, ``tau >= 1``: its payloads
    travel between the islands' programs while steps ``t + 1 .. t + tau`` compute."""
    due = functools.partial(due_fragment, sync_every=sync_every, num_fragments=num_fragments)
    return Phase(due(step), due(step - overlap))


def schedule_phases(sync_every, num_fragments=1, overlap=0, islands=False) -> list[Phase]:
    """Every distinct :class:`Phase` of the schedule, in order of first appearance (one compiled program
    each): two periods and the overlap cover every fragment's send and apply."""
    seen = []
    rule = island_phase if islands else phase
    for t in range(1, 2 * sync_every + overlap + 2):
        ph = rule(t, sync_every=sync_every, num_fragments=num_fragments, overlap=overlap)
        if ph not in seen:
            seen.append(ph)
    return seen


def traced_phase_index(t, phases, *, sync_every, num_fragments=1, overlap=0):
    """The index in ``phases`` of step ``t``'s phase, ``t`` traced (the ``lax.switch`` fallback): the same
    rule as :func:`phase`, in integer array arithmetic."""
    offsets = jnp.asarray(schedule_offsets(sync_every, num_fragments), jnp.int32)

    def due(step):
        hit = (step >= sync_every) & ((step - offsets) % sync_every == 0)
        return jnp.where(jnp.any(hit), jnp.argmax(hit), -1)

    send = due(t) if overlap == 0 else due(t - 1)
    apply = due(t) if overlap == 0 else due(t - overlap)
    index = jnp.int32(0)
    for i, ph in enumerate(phases):
        s = -1 if ph.send is None else ph.send
        a = -1 if ph.apply is None else ph.apply
        index = jnp.where((send == s) & (apply == a), i, index)
    return index


def per_replica(inner_state, replica_axes):
    """The inner state as stored: each leaf varying over the replica axis (``replica_axes``: it, or none for
    an island), a scalar as shape ``(1,)`` (a replica that skips a step keeps its own counts, and a scalar has
    no dim 0 to split over replicas)."""
    return jax.tree.map(lambda x: specs.to_varying(x.reshape((1,) if x.ndim == 0 else x.shape), replica_axes),
                        inner_state)


def replica_finite(tree, axis_name):
    """All of ``tree`` finite on every device of this replica (no collective over ``axis_name``)."""
    return all_finite(tree, decision_axes((axis_name,)))


class Exchange(NamedTuple):
    """How a fragment's outer gradient crosses ``axis_name``: the ``codec`` (:mod:`loco_jax.exchange`:
    :class:`~loco_jax.exchange.Exact`, :class:`~loco_jax.exchange.Dense` or
    :class:`~loco_jax.exchange.Sparse`, with its error step), and how the replicas' payloads move.

    Each of the ``D`` devices of ``data_axis`` in a replica holds the same parameters, so it sends its own
    ``1/D`` slice (:meth:`slice_len`, :meth:`my_slice`); the replicas' mean comes back per slice
    (:meth:`mean`), and every device gathers the whole fragment's mean inside the replica, as codes where
    they are fewer bytes (:meth:`gather_codes`) or as fp32 slices (:meth:`gather_slices`).
    """

    axis_name: str
    data_axis: str | None
    codec: Any  # exchange.Exact | exchange.Dense | exchange.Sparse
    mode: str  # a dense payload's collective: "two_stage" or "all_gather" (a sparse one's is an all_gather)
    islands: int | None = None  # M islands (as_islands): no replica axis; the payloads cross between programs

    @property
    def keep_unsent(self) -> bool:
        """A sparse exchange whose accumulator rides in the local parameters (``Sparse.keep_unsent``)."""
        return self.sparse and self.codec.keep_unsent

    @property
    def replica_axes(self) -> tuple:
        """The mesh axis the replicas meet on, as a tuple; none for islands."""
        return () if self.islands else (self.axis_name,)

    def sender_index(self, layout):
        """This data device's index where its payload depends on it (chunks that follow the leaves: binmean's
        per-leaf statistics), else 0."""
        return lax.axis_index(self.data_axis) if layout is not None and self.data_size() > 1 else 0

    def replicas(self) -> int:
        """``M``: the islands, or the devices of the replica axis."""
        return self.islands or coll.axis_size(self.axis_name)

    def payload_shape(self, p: int, k: int, layout=None) -> tuple:
        """The shape of one replica's :meth:`encode` payload of fragment ``p``'s ``k``-value slice."""
        feedback = self.codec.feedback
        errors = (None, None) if feedback is None else feedback.zeros((1, k))
        return jax.eval_shape(lambda x: self.encode(x, p, 1, *errors, layout=layout)[0],
                              jax.ShapeDtypeStruct((k,), jnp.float32)).shape

    @property
    def sparse(self) -> bool:
        return isinstance(self.codec, exchange_lib.Sparse)

    def tile_layout(self, shapes, d: int):
        """The fragment's :class:`loco_jax.sparse.TileLayout` for ``d`` data devices (``chunks="leaves"``):
        tiles of ``sqrt(C)`` per side, each slice a whole number of error blocks; None for flat chunks."""
        if not self.sparse or self.codec.chunks != "leaves":
            return None
        return _tile_layout(tuple(tuple(s) for s in shapes), d, math.isqrt(self.codec.code.chunk),
                            self.codec.block_size)

    def data_size(self) -> int:
        """``D``: the devices of ``data_axis`` bound in this ``shard_map`` (1 when none)."""
        if self.data_axis is None or self.data_axis not in specs.manual_axes():
            return 1
        return coll.axis_size(self.data_axis)

    def slice_len(self, size: int, d: int, m: int, layout=None) -> int:
        """``k``: values of one data device's slice of a fragment of ``size`` values, a whole number of
        blocks per replica: ``max(round_up(ceil(size / d), u), u)``, ``u = B`` (``M B`` two-stage;
        ``lcm(C, B)`` for a sparse exchange of chunk ``C``); with chunks that follow the leaves, the
        ``layout``'s slice."""
        if layout is not None:
            return layout.slice_len
        if self.sparse:  # whole chunks, and whole blocks of a quantized error buffer
            unit = math.lcm(self.codec.code.chunk, self.codec.block_size)
        else:
            unit = self.codec.block_size * (m if self.mode == "two_stage" else 1)
        return max(coll.round_up(-(-size // d), unit), unit)

    def my_slice(self, flat, k: int, d: int):
        """This device's slice: values ``[j k, (j + 1) k)`` of ``flat`` zero-padded to ``d k``."""
        padded = jnp.pad(flat, (0, k * d - flat.shape[0]))
        if d == 1:
            return padded
        return lax.dynamic_slice(padded, (lax.axis_index(self.data_axis) * k,), (k,))

    def gather_slices(self, mean_slice, size: int, d: int, layout=None):
        """The fragment's whole mean from every data device's fp32 slice (in extract order)."""
        if d > 1:
            mean_slice = lax.all_gather(mean_slice, self.data_axis, axis=0, tiled=True, to="invarying")
        return mean_slice[:size] if layout is None else layout.untiled(mean_slice)

    def gather_codes(self, codes, p: int, size: int, d: int, layout=None):
        """The fragment's whole mean from every data device's exchanged payloads, gathered as codes and
        decoded here: the same bytes through the same decode as :meth:`gather_slices`' fp32 slices, so the
        same values, in ``M x bits / 32`` of the bytes (and a decode of the whole fragment on every device)."""
        gathered, finish = codes
        with jax.named_scope(APPLY_GATHER):  # names it in the compiled program (benchmarks/gpu_schedule.py)
            every = lax.all_gather(gathered, self.data_axis, axis=0, to="invarying")  # (d, M, payload bytes)
        whole = self.codec.rotate_out(jax.vmap(finish)(every, jnp.arange(d)), p).reshape(-1)
        return whole[:size] if layout is None else layout.untiled(whole)

    def mean(self, slice_f32, p: int, error=None, error_scale=None, never=False, layout=None):
        """The mean over replicas of this device's slice of fragment ``p``'s outer gradient
        (docs/algorithms.md, "6. DiLoCo and Streaming DiLoCo", the exchange)::

            h = R_p x + e_p,   mean = R_p^T (1/M) sum_m DQ(Q_b(h^m)),
            e_p = Q_e(beta e_p + (1 - beta)(h - DQ(Q_b(h))))

        Returns ``(mean slice, new stored error or None, codes or None)``; ``codes`` is ``(gathered
        payloads, finish)`` with ``rotate_out(finish(gathered, j)) == mean slice`` on data device ``j``, for
        :meth:`gather_codes`.
        ``error``/``error_scale``: fragment ``p``'s stored error (with ``compensate``); ``never``: a traced
        false flag (:func:`loco_jax.exchange.rounded_apart`). On GPUs the exchange asks for a collective stream
        of its own (it crosses replicas: a slow link).
        """
        if self.sparse:
            return self.sparse_mean(slice_f32, error, error_scale, never, layout)
        axis_name, feedback = self.axis_name, self.codec.feedback
        m = coll.axis_size(axis_name)
        if self.codec.bits is None:
            return coll.on_own_stream(lambda: lax.pmean(slice_f32, axis_name)), None, None
        cfg = self.codec.quant
        if self.mode == "all_gather":
            payload, stored, finish = self.encode(slice_f32, p, m, error, error_scale, never)
            gathered = coll.on_own_stream(lambda: lax.all_gather(payload, axis_name, axis=0, tiled=True,
                                                                 to="invarying"))
            return cfg.rotate_out(finish(gathered)[None], p)[0], stored, (gathered, finish)
        h = cfg.rotate_in(slice_f32[None], p)[0]  # with rotate, the error lives in fragment p's rotated domain
        if feedback is not None:
            e = feedback.load(error, error_scale)[0]
            h = feedback.compensate(h, e, never)
        # the two-stage form: a reduce-scatter, then the all-gather of the re-quantized chunks
        chunk, sent = coll.reduce_scatter_rows(h.reshape(m, -1), axis_name, cfg, own_stream=True)
        _, _, gathered = coll.all_gather_chunk(chunk / m, axis_name, cfg, own_stream=True, with_payloads=True)
        finish, sent = (lambda g, _=0: cfg.decode(g, chunk.shape[0]).reshape(-1)), sent.reshape(-1)
        mean = cfg.rotate_out(finish(gathered)[None], p)[0]
        stored = None if feedback is None else feedback.update(e[None], h[None], sent[None], never)
        return mean, stored, (gathered, finish)

    def sparse_mean(self, slice_f32, error=None, error_scale=None, never=False, layout=None):
        """The sparse exchange of this device's slice (docs/algorithms.md, "6. DiLoCo and Streaming DiLoCo",
        the sparse exchange)::

            a = beta e + Delta,   s = C(a),   e = a - s,   mean = (1/M) sum_m s^m               ("replicas")
                                                             mean_i = sum_m s^m_i / max(1, n_i)   ("senders")

        where ``n_i`` counts the replicas whose payload holds entry ``i`` (read from the decoded positions).
        Over replicas, an entry one replica sent moves the mean by ``s/M``; over senders, by ``s``: the mean of
        those who sent it (SparseLoCo's reference code, ``scatter_reduce(reduce="mean")``). The two agree
        wherever every replica sends the same positions.

        (with ``keep_unsent``, ``a = Delta``: the replica restarted from ``theta~ - beta e``, so its outer
        gradient already holds the decayed accumulator)

        ``C`` keeps each chunk's top-k entries of ``a`` at the payload's bits (:mod:`loco_jax.sparse`); the
        replicas' payloads travel in one ``uint8`` ``all_gather`` and every replica decodes and averages them
        (entries a replica did not send count as zero). The accumulator ``e`` holds what was not sent (and
        the values' rounding), decayed by ``beta`` (1: plain error feedback; below 1 it also stands in for
        the outer momentum, SparseLoCo's rule: :func:`sparseloco_rule`); stored at ``error_bits`` (None:
        fp32). Returns what :meth:`mean` does (no rotation: ``codes``' finish gives the mean itself).
        ``layout`` (chunks that follow the leaves): the slice is in its tiled order, each class of chunks
        with its own ``k`` (:class:`loco_jax.sparse.TiledSparse`).
        """
        m = coll.axis_size(self.axis_name)
        own = self.sender_index(layout)
        payload, new, finish = self.encode(slice_f32, 0, m, error, error_scale, never, layout, own)
        gathered = coll.on_own_stream(lambda: lax.all_gather(payload, self.axis_name, axis=0, to="invarying"))
        return finish(gathered, own), new, (gathered, finish)

    def encode(self, slice_f32, p: int, m: int, error=None, error_scale=None, never=False, layout=None, own=0):
        """This replica's side of :meth:`mean` (the dense exchange's ``all_gather`` form, or the sparse one),
        with no collective: ``(payload, new stored error or None, finish)``.

        ``payload`` is the ``uint8`` array that crosses to the other ``m`` replicas; ``finish(gathered, j=0)``
        is the mean of their payloads, ``gathered`` holding one per replica in replica order (:meth:`combine`:
        the rows the mesh mode's ``all_gather`` over ``axis_name`` holds), in the rotated domain of a rotated
        dense exchange. The mesh mode gathers over ``axis_name``; the islands mode moves the payloads through
        the transfer server (:mod:`loco_jax.islands`). ``own``: this data device's index (tiled sparse chunks).
        """
        feedback = self.codec.feedback
        if self.sparse:
            return self._encode_sparse(slice_f32, m, error, error_scale, never, layout, own)
        cfg = self.codec.quant
        h = cfg.rotate_in(slice_f32[None], p)[0]  # with rotate, the error lives in fragment p's rotated domain
        e = None
        if feedback is not None:
            e = feedback.load(error, error_scale)[0]
            h = feedback.compensate(h, e, never)
        payload = cfg.encode(h[None])
        sent = cfg.decode(payload, h.shape[0])[0]
        stored = None if feedback is None else feedback.update(e[None], h[None], sent[None], never)
        return payload, stored, self.decoder(m, h.shape[0])

    def decoder(self, m: int, k: int, layout=None):
        """``finish(gathered, j=0)``: the mean of ``m`` replicas' :meth:`encode` payloads of ``k``-value slices
        (``gathered``: :meth:`combine`'s rows; ``j``: the data device that sent them, for tiled sparse chunks),
        in a rotated dense exchange's rotated domain."""
        if not self.sparse:
            cfg = self.codec.quant
            return lambda g, _=0: cfg.decode(g, k).sum(axis=0) / m
        code = self.codec.code if layout is None else _tiled_sparse(layout, self.codec.code)

        def finish(g, j=0):  # (M, ..., bytes) from data device j -> the mean of the M decoded slices
            args = () if layout is None else (j,)
            if self.codec.average_over == "senders":
                values, held = code.decode(g, *args, held=True)
                return values.sum(axis=0) / jnp.maximum(held.sum(axis=0), 1.0)
            return code.decode(g, *args).sum(axis=0) / m

        return finish

    def combine(self, payloads):
        """The ``M`` replicas' payloads of :meth:`encode`, in replica order, as the mesh mode's ``all_gather``
        holds them (dense: rows concatenated; sparse: stacked)."""
        return jnp.stack(payloads) if self.sparse else jnp.concatenate(payloads, axis=0)

    def _encode_sparse(self, slice_f32, m, error, error_scale, never, layout, own):
        feedback = self.codec.feedback
        e = None
        if self.keep_unsent:  # the replica's parameters already hold beta e
            acc = slice_f32
        else:
            e = feedback.load(error, error_scale)[0]
            acc = feedback.compensate(slice_f32, e, never)
        # a tiled slice's payload depends on which data device sends it (binmean's per-leaf statistics)
        code = self.codec.code if layout is None else _tiled_sparse(layout, self.codec.code)
        payload, sent = code.encode(acc) if layout is None else code.encode(acc, own)
        new = feedback.update(None if e is None else e[None], acc[None], sent[None], never)
        return payload, new, self.decoder(m, acc.shape[0], layout)


def merge(plan, p, mean_delta, global_params, local, outer, outer_state, alpha, delivered, restart=None):
    """Fragment ``p``'s apply: the outer step on the exchanged mean, then the merge into the local parameters::

        theta~_p = theta_g,p + OuterOpt_p.update(mean Delta_p),   theta_p = alpha theta_p + (1 - alpha) theta~_p,
        theta_g,p = theta~_p

    ``restart`` (a flat fragment, or None): added to ``theta~_p`` where the local parameters restart
    (``keep_unsent``: ``theta_p(t + tau) - theta_p(t) - beta e_p``, the replica's own unsent progress).

    Where the round was dropped (``delivered`` false: a non-finite mean), the fragment's global parameters,
    outer state and local parameters stay as they are. Returns ``(global_params, local, outer_state)``.
    """
    global_pieces = plan.select(global_params, p)
    outer_updates, new_outer = outer.update(_split(mean_delta, global_pieces), outer_state, global_pieces)
    merged = optax.apply_updates(global_pieces, outer_updates)
    merged_flat = jnp.concatenate([x.astype(jnp.float32).reshape(-1) for x in merged])
    local_flat = plan.extract(local, p)
    target = merged_flat if restart is None else merged_flat + restart
    mixed = alpha * local_flat + (1.0 - alpha) * target
    merged_flat = jnp.where(delivered, merged_flat, plan.extract(global_params, p))
    mixed = jnp.where(delivered, mixed, local_flat)
    return (plan.insert(global_params, p, merged_flat), plan.insert(local, p, mixed),
            select(delivered, new_outer, outer_state))


@functools.lru_cache(maxsize=64)
def _tile_layout(shapes, d, tile, align):
    return sparse_lib.tile_layout(shapes, d, tile=tile, align=align)


def _tiled_sparse(layout, cfg):
    k = cfg.k / cfg.chunk  # the density the flat config was built with, k = round(density C)
    return sparse_lib.tiled_sparse(layout, k, bits=cfg.bits, format=cfg.format)


def relayout_inflight(inflight, sizes, fragment, old_mesh, new_mesh, slice_len, layout=None):
    """The in-flight mean of ``fragment`` written on ``old_mesh``, cut into ``new_mesh``'s slices.

    ``inflight`` is the global (host) view of ``DiLoCoState.inflight`` on ``old_mesh = (M, D)`` (D: the data
    devices the optimizer slices over, 1 when ``data_axis`` is None): D rows of ``k_max`` values, row ``j``
    holding data device ``j``'s slice of ``mean_m(theta_global - theta_m)`` (identical on every replica).
    Row ``j``'s first ``k(D, M)`` values are its slice, so concatenating them and keeping the fragment's
    ``n_p`` values gives the whole mean, which is cut again into ``k(D', M')``-value slices and padded to the
    new ``k_max``. Applying the result on the new mesh is exactly the apply the old mesh would have made:
    the exchange is completed, not dropped. ``sizes``: every fragment's size; ``slice_len(size, d, m,
    layout)``; ``layout(p, d)``: fragment ``p``'s :class:`loco_jax.sparse.TileLayout` on ``d`` data devices
    (chunks that follow the leaves: the slices hold the tiled order, which depends on ``d``, so the mean is
    untiled on the old layout and tiled on the new one), or None (flat order).
    """
    (m_old, d_old), (m_new, d_new) = old_mesh, new_mesh
    size = sizes[fragment]
    at = (lambda p, d: None) if layout is None else layout
    old, new = at(fragment, d_old), at(fragment, d_new)
    k_old, k_new = slice_len(size, d_old, m_old, old), slice_len(size, d_new, m_new, new)
    inflight = np.asarray(inflight, np.float32)
    if inflight.shape[0] % d_old or inflight.shape[0] // d_old < k_old:
        raise ValueError(
            f"inflight of shape {inflight.shape} does not hold {d_old} slices of {k_old} values "
            f"(fragment {fragment} of {size} values on mesh replica={m_old}, data={d_old})."
        )
    slices = inflight.reshape(d_old, -1)[:, :k_old].reshape(-1)
    mean = slices[:size] if old is None else np.asarray(old.untiled(jnp.asarray(slices)))
    k_max = max(slice_len(s, d_new, m_new, at(p, d_new)) for p, s in enumerate(sizes))
    out = np.zeros((d_new, k_max), np.float32)
    cut = np.pad(mean, (0, k_new * d_new - size)) if new is None else np.asarray(new.tiled(jnp.asarray(mean)))
    out[:, :k_new] = cut.reshape(d_new, k_new)
    return out.reshape(-1)


SPARSE_FORMATS = exchange_lib.SPARSE_FORMATS  # a sparse exchange's values' format per width (format None)


OUTER_LR, OUTER_MOMENTUM = 0.7, 0.9  # the default outer step (outer=None): Nesterov SGD


def sparseloco_rule(sparse_exchange: exchange_lib.Sparse, lr: float = 1.0, beta: float = 0.95) -> dict:
    """SparseLoCo's outer rule as ``diloco(...)`` arguments: the error-feedback accumulator of ``sparse_exchange``,
    decayed by ``beta``, takes the place of the outer momentum, and the outer step is plain SGD at ``lr``::

        diloco.diloco(inner, sync_every=30, **diloco.sparseloco_rule(exchange.Sparse.of(1 / 64)))

    The default rule (``outer=None``, ``Sparse.of(decay=1)``) is Nesterov SGD (lr 0.7, momentum 0.9) on the
    decoded mean, with plain error feedback, as MuLoCo keeps it.
    """
    if not isinstance(sparse_exchange, exchange_lib.Sparse):
        raise ValueError(f"sparseloco_rule({sparse_exchange!r}): the rule decays a sparse exchange's accumulator; "
                         "pass exchange.Sparse.of(density, ...).")
    return dict(outer=optax.sgd(lr), bits=sparse_exchange._replace(decay=float(beta)))


def codec(
    bits: int | None = None,
    *,
    preset: exchange_lib.Preset = "measured",
    format: quant.Format | None = None,
    compensate: bool | None = None,
    rotate: bool | None = None,
    block_size: int = quant.DEFAULT_BLOCK_SIZE,
    error_beta: float = 0.8,
    error_bits: int | None = 8,
    seed: int = 0,
) -> exchange_lib.Dense | exchange_lib.Exact:
    """The dense outer exchange for ``bits``, as one checked value (:mod:`loco_jax.exchange`):
    ``diloco(inner, bits=b)`` runs ``codec(b)``. (A sparse one is ``exchange.Sparse.of(density, ...)``.)

    Args:
      bits: 8, 4, 2 or 1 bits per value on the wire, or ``None`` (the exact fp32 mean).
      preset: where the ``None`` settings come from: :data:`MEASURED`'s per-bit defaults (``"measured"``)
        or the paper's (``"reference"``: int, no rotation, no compensation); see :func:`settings`.
      format: payload format, one of :data:`quant.FORMATS` (``"e3m0"`` is the paper's 4-bit choice).
      compensate: LoCo error feedback on the outer gradients, per fragment.
      rotate: exchange in a randomized-Hadamard domain (one rotation per fragment from ``seed``;
        power-of-two ``block_size``); the error buffer lives in that domain.
      block_size, error_beta, error_bits: the quantizer's block, the error buffer's moving-average weight
        in [0, 1), and its storage bits (None: fp32).
      seed: the rotations' seed.
    """
    resolved = settings(bits, preset, format=format, compensate=compensate, rotate=rotate)
    if format in sparse_lib.SPARSE_FORMAT_BITS:
        raise ValueError(f"format={format!r} quantizes the kept values of a sparse exchange; use "
                         f"exchange.Sparse.of(density, format={format!r}), or choose one of {quant.FORMATS}.")
    if rotate and bits is None:
        raise ValueError("rotate=True rotates a quantized exchange, but bits=None exchanges exact fp32; set bits.")
    if compensate and bits is None:
        raise ValueError("compensate=True compensates quantization error, but bits=None exchanges exact fp32; set bits.")
    if bits is None:
        return exchange_lib.Exact(block_size).checked("error_beta", format=resolved["format"], error_bits=error_bits,
                                                      beta=error_beta)
    return exchange_lib.Dense(bits, resolved["format"], resolved["rotate"], block_size, resolved["compensate"],
                              error_beta, error_bits, seed).checked("error_beta")


def _exchange_value(bits, mode):
    """``diloco``'s ``bits`` as a checked exchange value (an int or None through :func:`codec`), with the
    collective ``mode`` it travels by."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {MODES}.")
    if isinstance(bits, exchange_lib.Sparse):
        if mode != "all_gather":
            raise ValueError(f"the sparse exchange ({bits.code.k} of every {bits.code.chunk} entries) is an "
                             f"all_gather of every replica's entries; mode={mode!r} is for dense payloads (use "
                             "mode='all_gather').")
        return bits
    if isinstance(bits, exchange_lib.Dense):
        if bits.compensate_second_stage or bits.stochastic_rounding:
            raise ValueError(f"diloco({bits!r}): compensate_second_stage and stochastic_rounding are LoCo's "
                             "(loco.compress); the outer exchange quantizes once, to nearest.")
        return bits.checked("error_beta")
    if isinstance(bits, exchange_lib.Exact):
        return bits.checked()
    if bits is not None and not is_int(bits):
        raise ValueError(f"diloco(bits={bits!r}): bits is 8, 4, 2 or 1, None (the exact fp32 mean), or an "
                         "exchange value (diloco.codec(...), exchange.Sparse.of(...)).")
    return codec(bits)


def _validate(sync_every, num_fragments, overlap, alpha):
    require_int("sync_every", sync_every)
    require_int("num_fragments", num_fragments)
    if num_fragments > sync_every:
        raise ValueError(
            f"num_fragments={num_fragments} exceeds sync_every={sync_every}: each fragment needs its own step "
            f"offset floor(p * H / P); use num_fragments <= {sync_every}."
        )
    limit = sync_every // num_fragments
    if not is_int(overlap) or not 0 <= overlap < limit:
        raise ValueError(
            f"overlap={overlap!r} must be an integer in [0, floor(H / P)) = [0, {limit}) so that at most one "
            f"fragment is in flight (H={sync_every}, P={num_fragments})."
        )
    if not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha!r} must lie in [0, 1] (0 drops local steps taken meanwhile, 1 never merges).")


def _validate_keep_unsent(codec_value, alpha, overlap):
    if not (isinstance(codec_value, exchange_lib.Sparse) and codec_value.keep_unsent):
        return
    if alpha != 0:
        raise ValueError(f"keep_unsent=True with alpha={alpha}: the replica already keeps all of its own progress; "
                         "alpha would count it twice (use alpha=0).")
    if overlap > 1:
        raise ValueError(f"keep_unsent=True with overlap={overlap}: the restart is made in the program that "
                         "exchanges, so the overlap must lie in [0, 1].")


# The outer exchange's reference (the paper's int/e3m0 payloads, no rotation, no compensation) and the
# per-bit defaults that ``diloco(bits=b)`` uses when format / rotate / compensate are None, measured at the
# all-gather, block-256 wire budget (docs/results.md, "Low-bit quality").
REFERENCE = dict(format="int", rotate=False, compensate=False)
# The tables the per-bit defaults were chosen from: docs/results.md, "Streaming DiLoCo's outer exchange at 2
# and 1 bits" and "Streaming DiLoCo's 4-bit outer exchange" (seed 0, M = 2), and "Streaming DiLoCo at parity
# with data parallel" (3,000 steps, seeds 1-3). 8 bits was not measured and keeps the reference.
MEASURED = {
    8: dict(REFERENCE),
    4: dict(format="lloyd", rotate=True, compensate=False),
    2: dict(format="lloyd", rotate=True, compensate=False),
    1: dict(format="int", rotate=True, compensate=False),
}
SETTING_NAMES = tuple(REFERENCE)
PRESETS = exchange_lib.PRESETS


def settings(bits, preset="measured", density=None, **given):
    """Resolved outer-exchange settings for ``bits``: ``given`` values that are not None, else the preset's.
    A sparse exchange (``density`` set): the values' format of :data:`SPARSE_FORMATS`, never rotated, always
    compensated (its error feedback)."""
    if density is not None:
        return dict(format=given.get("format") or SPARSE_FORMATS.get(bits, "int"), rotate=False, compensate=True)
    out = exchange_lib.preset_settings(bits, preset, given, reference=REFERENCE, measured=MEASURED, what="outer-exchange")
    if bits is None:  # an exact exchange: nothing to rotate or compensate unless asked (and then refused)
        out.update({k: bool(given.get(k)) for k in ("rotate", "compensate")})
    return out


def settings_of(fields) -> dict:
    """:func:`settings` of a mapping of ``diloco``'s arguments (a config's section): its ``bits``,
    ``preset``, ``density`` and :data:`SETTING_NAMES`; other keys are not read."""
    return settings(fields["bits"], fields.get("preset", "measured"), fields.get("density"),
                    **{n: fields.get(n) for n in SETTING_NAMES})


class DiLoCo(optax.GradientTransformationExtraArgs):
    """An ``optax.GradientTransformationExtraArgs`` with the schedule attached.

    ``init(params)`` and ``update(grads, state, params, phase=None)`` run
    inside ``shard_map``. Plain Python: :meth:`phase` (the :class:`Phase` of
    an inner step), :meth:`phases` (every distinct phase: one compiled program
    each), :meth:`plan` (the :class:`fragments.FragmentPlan`) and
    :meth:`relayout_inflight` (an elastic restart's in-flight mean).
    """

    def __new__(cls, loop: "OuterLoop"):
        tx = super().__new__(cls, loop.init, loop.update)
        tx.loop = loop  # the settings and the steps (a NamedTuple holds only init and update)
        return tx

    def phase(self, step: int) -> Phase:
        return (island_phase if self.loop.ex.islands else phase)(step, **self.loop.schedule)

    def phases(self) -> list[Phase]:
        return schedule_phases(**self.loop.schedule, islands=bool(self.loop.ex.islands))

    def payload_bytes(self, params, p: int, d: int = 1) -> int:
        """Islands: the bytes of one data device's payload of fragment ``p`` (the head of its ``outbox``),
        for an island of ``d`` data devices (``params``: one island's)."""
        loop, plan = self.loop, self.plan(params)
        layout = loop.layouts(plan, params, d)[p]
        k = loop.ex.slice_len(plan.fragment_sizes()[p], d, loop.ex.replicas(), layout)
        return math.prod(loop.ex.payload_shape(p, k, layout))

    def plan(self, params) -> frag.FragmentPlan:
        """The fragment plan of ``params`` (cached per tree structure and shapes); refuses a tree it cannot
        split into the fragments asked for, by name."""
        return self.loop.plan_of(params)

    def relayout_inflight(self, inflight, params, fragment, old_mesh, new_mesh):
        """The in-flight mean of ``fragment`` (every device's slice, host NumPy) re-cut from mesh ``old_mesh``
        to ``new_mesh`` (each ``(replicas, data devices)``): :func:`relayout_inflight` with this exchange's
        slices and tile layouts."""
        plan = self.plan(params)
        # the fragments' tile layouts per data size (all None with flat chunks), as the exchange builds them
        layouts = functools.lru_cache(maxsize=None)(lambda d: self.loop.layouts(plan, params, d))
        return relayout_inflight(inflight, plan.fragment_sizes(), fragment, old_mesh, new_mesh, self.loop.ex.slice_len,
                                 lambda p, d: layouts(d)[p])


class OuterLoop(NamedTuple):
    """What :func:`diloco` builds: its settings, and the transformation's ``init`` and ``update`` as methods
    (the inner step, one phase's step, the phase choice). ``plan_of(params)`` is the fragment plan."""

    inner: optax.GradientTransformationExtraArgs
    outer: optax.GradientTransformation
    ex: Exchange
    num_fragments: int
    overlap: int
    alpha: float
    schedule: dict  # sync_every, num_fragments, overlap: the arguments of phase() and schedule_phases()
    plan_of: Any

    def init(self, params):
        """The state: inner state per replica, global parameters (the replicas' mean), one outer state per
        fragment, step counts, the in-flight slot and the error buffers (module docstring)."""
        islands, axes = self.ex.islands, self.ex.replica_axes
        if not islands:
            specs.require_axis(self.ex.axis_name, "diloco")
        plan = self.plan_of(params)
        d, m = self.ex.data_size(), self.ex.replicas()
        # islands start from the same parameters (the same seed on each): theirs are the global ones
        global_params = params if islands else jax.tree.map(lambda x: lax.pmean(x, self.ex.axis_name), params)
        outer_states = tuple(self.outer.init(plan.select(global_params, p)) for p in range(self.num_fragments))
        layouts = self.layouts(plan, params, d)
        k = [self.ex.slice_len(s, d, m, lay) for s, lay in zip(plan.fragment_sizes(), layouts)]
        device_axes = specs.manual_axes()
        # only tau >= 2 holds a mean across steps (1: orbax saves no empty array)
        held = max(k) if self.overlap >= 2 else 1
        # the slot holds this device's slice: varying over the sliced axis, and over any axis the parameters
        # themselves vary over besides the replica axis (FSDP shards)
        slot_axes = set(a for a in (self.ex.data_axis,) if a in device_axes)
        slot_axes |= set().union(*(specs.varying_axes(x) for x in jax.tree.leaves(params))) - {self.ex.axis_name}
        slot_axes = tuple(a for a in device_axes if a in slot_axes)
        inflight = specs.to_varying(jnp.zeros((held,), jnp.float32), slot_axes)
        error, error_scale = (), ()
        feedback = self.ex.codec.feedback
        if feedback is not None:
            stored = [jax.tree.map(lambda x: specs.to_varying(x, device_axes), feedback.zeros((1, kp))) for kp in k]
            error, error_scale = tuple(s[0] for s in stored), tuple(s[1] for s in stored)
        zero = jnp.zeros((), jnp.int32)
        skipped = specs.to_varying(jnp.zeros((1,), jnp.int32), axes)  # one count per replica
        outbox = None
        if islands:  # room for the largest fragment's payload
            most = max(math.prod(self.ex.payload_shape(p, kp, lay)) for p, (kp, lay) in enumerate(zip(k, layouts)))
            outbox = specs.to_varying(jnp.zeros((most,), jnp.uint8), slot_axes)
        return DiLoCoState(per_replica(self.inner.init(params), axes), global_params, outer_states, zero,
                           skipped, inflight, error, error_scale, zero, outbox)

    def layouts(self, plan, params, d):
        """Each fragment's tile layout (chunks that follow the leaves; else Nones), from its pieces' shapes
        as this device holds them (FSDP: its shards)."""
        if not self.ex.sparse or self.ex.codec.chunks != "leaves":
            return [None] * self.num_fragments
        shapes = [[x.shape for x in jax.eval_shape(lambda t, p=p: plan.select(t, p), params)]
                  for p in range(self.num_fragments)]
        return [self.ex.tile_layout(sh, d) for sh in shapes]

    def inner_step(self, grads, state, params, extra):
        """This replica's inner step, or none where its gradients or updates are non-finite."""
        own = jax.eval_shape(self.inner.init, params)  # the inner state's own shapes (scalars are stored as (1,))
        inner_in = jax.tree.map(lambda x, a: x.reshape(a.shape), state.inner, own)
        # replicas train alone: the inner optimizer's decisions are agreed within this replica only
        extra = dict(extra, **{INDEPENDENT: tuple(extra.get(INDEPENDENT, ())) + self.ex.replica_axes})
        updates, new_inner = self.inner.update(grads, inner_in, params, **extra)
        ok = replica_finite((grads, updates), self.ex.axis_name)
        updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), updates)
        kept = select(ok, per_replica(new_inner, self.ex.replica_axes), state.inner)
        return optax.apply_updates(params, updates), kept, ok

    def step(self, ph: Phase, grads, state, params, extra):
        """One step of phase ``ph``: the inner step, fragment ``ph.send``'s exchange, fragment ``ph.apply``'s
        merge; ``(updates, new state)``."""
        plan = self.plan_of(params)
        d, m = self.ex.data_size(), coll.axis_size(self.ex.axis_name)
        sizes = plan.fragment_sizes()
        layouts = self.layouts(plan, params, d)
        local, inner_state, inner_ok = self.inner_step(grads, state, params, extra)
        global_params, outer_states = state.global_params, list(state.outer)
        inflight, error, error_scale = state.inflight, list(state.error), list(state.error_scale)
        dropped = state.dropped

        mean_now = codes_now = restart = unsent = None
        if ph.send is not None:
            p = ph.send
            k = self.ex.slice_len(sizes[p], d, m, layouts[p])
            snapshot = local if self.overlap == 0 else params  # params of step t+1 are theta(t)
            snapshot_p = plan.extract(snapshot, p)
            stored_error = (error[p], error_scale[p]) if error else (None, None)
            mean_slice, stored, codes = self.ex.mean(self.send_slice(plan, p, global_params, snapshot_p, local,
                                                                     layouts[p], k, d),
                                                     p, *stored_error, never=state.step < 0, layout=layouts[p])
            if self.ex.keep_unsent and ph.apply == p:  # overlap <= 1: this program applies it (diloco's check)
                unsent = (stored, snapshot_p)
            # the same on every replica: they all decoded the same payloads
            sent_ok = replica_finite(mean_slice, self.ex.axis_name)
            dropped = dropped + (~sent_ok).astype(jnp.int32)
            if stored is not None:  # a dropped round was not delivered: its error is not fed back
                error[p], error_scale[p] = select(sent_ok, stored, (error[p], error_scale[p]))
            if ph.apply == p:
                mean_now, codes_now = mean_slice, codes
            else:  # a dropped round leaves the slot empty (NaN): its apply step leaves the fragment out
                inflight = jnp.where(sent_ok, jnp.pad(mean_slice, (0, inflight.shape[0] - k)), jnp.nan)

        if ph.apply is not None:
            p = ph.apply
            k = self.ex.slice_len(sizes[p], d, m, layouts[p])
            mean_slice = mean_now if mean_now is not None else coll.after(inflight[:k], (local, dropped))
            # a dropped round (now, or at its send step): the fragment keeps its values
            delivered = replica_finite(mean_slice, self.ex.axis_name)
            mean_delta = self.whole_mean(p, mean_slice, codes_now, delivered, sizes[p], d, k, layouts[p])
            if unsent is not None:  # the replica's own unsent progress (keep_unsent)
                restart = self.restart(plan, p, local, unsent, mean_delta, sizes[p], d, layouts[p])
            global_params, local, outer_states[p] = merge(plan, p, mean_delta, global_params, local, self.outer,
                                                          outer_states[p], self.alpha, delivered, restart)

        updates = jax.tree.map(lambda new, old: new - old, local, params)
        return updates, DiLoCoState(
            inner_state, global_params, tuple(outer_states), state.step + 1,
            state.skipped + (~inner_ok).astype(jnp.int32), inflight, tuple(error), tuple(error_scale), dropped,
        )

    def send_slice(self, plan, p, global_params, snapshot_p, local, layout, k, d):
        """This device's ``k``-value slice of fragment ``p``'s outer gradient ``theta_g,p - snapshot_p`` (in the
        tiled order of chunks that follow the leaves). XLA:CPU: the exchange follows the inner step's
        collectives (on GPUs it overlaps them)."""
        delta = coll.after(plan.extract(global_params, p) - snapshot_p, local)
        if layout is not None:
            delta = layout.tiled(delta)
        return self.ex.my_slice(delta, k, d)

    def island_step(self, ph: Phase, grads, state, params, extra):
        """One step of an island (:func:`as_islands`): the inner step; fragment ``ph.send``'s payload encoded
        from ``theta(t)`` into ``outbox`` (its error fed back now); fragment ``ph.apply``'s mean decoded from
        ``extra["inbox"]`` (every island's payload of it, ``(M, bytes)``, in island order) and merged, as the
        mesh mode merges it. A non-finite mean drops the round, as there; the error was fed back at the send."""
        inbox = extra.pop("inbox", None)
        plan, d, m = self.plan_of(params), self.ex.data_size(), self.ex.islands
        sizes, layouts = plan.fragment_sizes(), self.layouts(plan, params, d)
        local, inner_state, inner_ok = self.inner_step(grads, state, params, extra)
        global_params, outer_states, outbox = state.global_params, list(state.outer), state.outbox
        error, error_scale, dropped = list(state.error), list(state.error_scale), state.dropped
        k = lambda p: self.ex.slice_len(sizes[p], d, m, layouts[p])
        if ph.send is not None:
            p = ph.send
            stored_error = (error[p], error_scale[p]) if error else (None, None)
            payload, stored, _ = self.ex.encode(
                self.send_slice(plan, p, global_params, plan.extract(local, p), local, layouts[p], k(p), d), p, m,
                *stored_error, never=state.step < 0, layout=layouts[p], own=self.ex.sender_index(layouts[p]))
            if stored is not None:
                error[p], error_scale[p] = stored
            outbox = jnp.pad(payload.reshape(-1), (0, outbox.shape[0] - payload.size))
        if ph.apply is not None:
            p = ph.apply
            if inbox is None:
                raise ValueError(f"phase {ph} applies fragment {p}: pass every island's payload of it, "
                                 "update(..., phase=phase, inbox=<(M, bytes) uint8>).")
            shape = self.ex.payload_shape(p, k(p), layouts[p])
            rows = inbox[:, :math.prod(shape)]
            gathered = self.ex.combine([rows[j].reshape(shape) for j in range(m)])
            finish = self.ex.decoder(m, k(p), layouts[p])
            mean_slice = self.ex.codec.rotate_out(finish(gathered, self.ex.sender_index(layouts[p]))[None], p)[0]
            delivered = replica_finite(mean_slice, self.ex.axis_name)
            dropped = dropped + (~delivered).astype(jnp.int32)
            mean_delta = self.ex.gather_slices(coll.after(mean_slice, delivered), sizes[p], d, layouts[p])
            global_params, local, outer_states[p] = merge(plan, p, mean_delta, global_params, local, self.outer,
                                                          outer_states[p], self.alpha, delivered)
        updates = jax.tree.map(lambda new, old: new - old, local, params)
        return updates, DiLoCoState(
            inner_state, global_params, tuple(outer_states), state.step + 1,
            state.skipped + (~inner_ok).astype(jnp.int32), state.inflight, tuple(error), tuple(error_scale), dropped,
            outbox)

    def whole_mean(self, p, mean_slice, codes, delivered, size, d, k, layout):
        """Fragment ``p``'s whole mean on every device of the replica, from this device's slice. The
        exchanged codes move where they are fewer bytes than the fp32 slice (held across steps, tau >= 2,
        the slot keeps fp32). XLA:CPU: the gather follows the check across replicas (``delivered``)."""
        if d > 1 and codes is not None and codes[0].size < GATHER_CODES_BELOW * k:
            gathered, finish = codes
            return self.ex.gather_codes((coll.after(gathered, delivered), finish), p, size, d, layout)
        return self.ex.gather_slices(coll.after(mean_slice, delivered), size, d, layout)

    def restart(self, plan, p, local, unsent, mean_delta, size, d, layout):
        """``keep_unsent``: fragment ``p``'s restart values less the global ones, the replica's own local
        progress less its decayed accumulator (``unsent``: the stored accumulator and the send step's
        snapshot). XLA:CPU: gathered after the mean."""
        (held, held_scale), snapshot_p = unsent
        held = self.ex.codec.feedback.load(held, held_scale)[0]
        held = self.ex.gather_slices(coll.after(self.ex.codec.decay * held, mean_delta), size, d, layout)
        return plan.extract(local, p) - snapshot_p - held

    def update(self, grads, state, params=None, phase=None, **extra):
        """optax's ``update``: the static phase ``phase`` (one compiled program per phase), or, without it, a
        ``lax.switch`` on the traced step count."""
        if params is None:
            raise ValueError("diloco.update needs params: call tx.update(grads, state, params).")
        if self.ex.islands:
            if not isinstance(phase, Phase):
                raise ValueError(f"phase={phase!r}: an island's update takes its static phase, tx.phase(step) "
                                 "(its payloads cross between programs, not inside one).")
            return self.island_step(phase, grads, state, params, dict(extra))
        specs.require_axis(self.ex.axis_name, "diloco")
        if phase is not None:
            if not isinstance(phase, Phase):
                raise ValueError(f"phase={phase!r} must be a diloco.Phase from tx.phase(step).")
            return self.step(phase, grads, state, params, extra)
        phases = schedule_phases(**self.schedule)
        index = traced_phase_index(state.step + 1, phases, **self.schedule)
        branches = [functools.partial(self.step, ph, extra=extra) for ph in phases]
        return lax.switch(index, branches, grads, state, params)



def diloco(
    inner: optax.GradientTransformation,
    *,
    sync_every: int,
    bits: int | None | exchange_lib.Exact | exchange_lib.Dense | exchange_lib.Sparse = None,
    outer: optax.GradientTransformation | None = None,
    alpha: float = 0.0,
    num_fragments: int = 1,
    overlap: int = 0,
    fragment_by: frag.Strategy | Any = "strided",
    axis_name: str = "replica",
    data_axis: str | None = "data",
    mode: coll.Mode = "all_gather",
) -> DiLoCo:
    """(Streaming) DiLoCo around ``inner``; see the module docstring for the maths.

    What crosses ``axis_name`` is one exchange value (:mod:`loco_jax.exchange`); the schedule (H, the
    fragments, the overlap), the outer step and the merge are this function's::

        diloco(inner, sync_every=30, num_fragments=3, overlap=1, bits=4)                 # codec(4)
        diloco(inner, sync_every=30, bits=diloco.codec(4, format="e3m0", preset="reference"))
        diloco(inner, sync_every=30, bits=exchange.Sparse.of(0.03, decay=0.95), outer=optax.sgd(1.0))

    Args:
      inner: the inner optimizer (e.g. ``optax.chain(loco.compress(...),
        optax.adamw(...))``), run every step on each replica.
      sync_every: H, inner steps between two syncs of a fragment.
      bits: outer-gradient bits on the wire (8, 4, 2, 1: :func:`codec`'s
        per-bit defaults) or None (fp32). Or the exchange itself:
        :func:`codec`'s value, ``exchange.Dense(...)``, ``exchange.Exact()`` or
        ``exchange.Sparse.of(density, ...)`` (SparseLoCo's rule with it:
        :func:`sparseloco_rule`).
      outer: outer optimizer on the outer gradient ``theta_global -
        theta_local``; ``None`` is SGD lr 0.7 with Nesterov momentum 0.9.
      alpha: weight of the local parameters when merging, in ``[0, 1]``.
      num_fragments: P; 1 is vanilla DiLoCo.
      overlap: tau, steps the exchange may take, in ``[0, floor(H / P))``.
      fragment_by: how fragments are formed (:func:`fragments.plan`):
        ``"strided"`` or ``"sequential"`` over the detected blocks, or explicit
        labels (a pytree of ints with the parameters' structure, or a callable
        returning one).
      axis_name: the replica mesh axis.
      data_axis: mesh axis inside a replica whose devices hold identical
        parameters; each sends a 1/D slice. ``None`` or unbound: no slicing.
      mode: ``"all_gather"`` (default, one quantization) or ``"two_stage"``;
        a sparse exchange is an all_gather.
    """
    codec_value = _exchange_value(bits, mode)
    _validate(sync_every, num_fragments, overlap, alpha)
    _validate_keep_unsent(codec_value, alpha, overlap)
    if outer is None:
        outer = optax.sgd(OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    ex = Exchange(axis_name, data_axis, codec_value, mode)
    schedule = dict(sync_every=sync_every, num_fragments=num_fragments, overlap=overlap)
    by_name = isinstance(fragment_by, str)
    strategy, labels = (fragment_by, None) if by_name else ("strided", fragment_by)

    @functools.lru_cache(maxsize=8)
    def _plan_for(treedef, shapes):
        abstract = jax.tree.unflatten(treedef, [jax.ShapeDtypeStruct(s, d) for s, d in shapes])
        return frag.plan(abstract, num_fragments, strategy=strategy, labels=labels)

    def plan_of(params):
        leaves, treedef = jax.tree.flatten(params)
        return _plan_for(treedef, tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in leaves))

    loop = OuterLoop(optax.with_extra_args_support(inner), outer, ex, num_fragments, overlap, alpha, schedule,
                     plan_of)
    return DiLoCo(loop)


def as_islands(tx: DiLoCo, islands: int) -> DiLoCo:
    """``tx`` run as one of ``islands`` separate JAX jobs (:mod:`loco_jax.islands`), with no ``replica`` axis.

    Its programs are the mesh mode's with the exchange cut at its collective: fragment ``p`` due after step
    ``t`` is encoded at the end of step ``t`` into ``state.outbox`` (the head of it:
    :meth:`DiLoCo.payload_bytes`); the host offers it to the other islands and pulls theirs while steps
    ``t + 1 .. t + tau`` run; step ``t + tau``'s ``update(..., phase=tx.phase(t + tau), inbox=...)`` takes the
    ``M`` payloads in island order and merges their mean (:func:`island_phase`). The mean, the outer step
    and the merge are the mesh mode's with overlap ``tau``, to the bit (``tests/test_islands.py``).
    Needs ``overlap >= 1`` (a payload leaves a program only when it ends) and a quantized exchange (dense in
    the ``all_gather`` form, or sparse); ``keep_unsent`` is not built for islands.
    """
    loop = tx.loop
    if not is_int(islands) or islands < 1:
        raise ValueError(f"islands={islands!r} must be a positive int: the number of islands (replicas).")
    if loop.overlap < 1:
        raise ValueError(f"islands need overlap >= 1 (this DiLoCo has overlap={loop.overlap}): a payload leaves "
                         "a program only when it ends, so it is applied one step later at the earliest.")
    if loop.ex.codec.bits is None or (not loop.ex.sparse and loop.ex.mode != "all_gather"):
        raise ValueError(f"islands exchange quantized payloads in the all_gather form (bits set, mode='all_gather', "
                         f"or a sparse exchange); this DiLoCo has bits={loop.ex.codec.bits}, mode={loop.ex.mode!r}.")
    if loop.ex.keep_unsent:
        raise ValueError("keep_unsent is not built for islands: its restart is made in the program that exchanges.")
    return DiLoCo(loop._replace(ex=loop.ex._replace(islands=int(islands))))


def _split(flat, like):
    """Pieces of ``flat`` shaped and typed like the arrays in ``like``."""
    out, start = [], 0
    for x in like:
        n = math.prod(x.shape)
        out.append(flat[start : start + n].reshape(x.shape).astype(x.dtype))
        start += n
    return out


def global_params(state: DiLoCoState):
    """The global parameters (identical on every replica): evaluate and export these."""
    return state.global_params


def state_specs(tx, params, mesh, in_specs=P("replica")):
    """``PartitionSpec`` of every leaf of ``tx.init(params)`` on ``mesh``.

    ``in_specs`` is how ``params`` enter the ``shard_map`` (default: split on
    dim 0 over ``replica``, one block of local parameters per replica, the
    layout :mod:`loco_jax.specs` describes).
    """
    return specs.output_specs(tx.init, params, mesh=mesh, in_specs=(in_specs,))
