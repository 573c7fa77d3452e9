"""LoCo: error-compensated low-bit gradient communication, as an optax transformation.

``optax.chain(loco.compress(bits=4), optax.adamw(3e-4))`` under ``jax.shard_map``
averages gradients over ``axis_name`` with ``bits``-bit payloads. Per worker,
at step ``t`` (the first ``update`` is ``t = 1``), with stored error ``e``
(zero at start)::

    if t % reset_every == 0:  e = 0                      # all buffers at once
    h     = g + e                                        # compensate
    c     = Q_b(h)                                       # compress; c is what crosses the network
    e_new = beta * e + (1 - beta) * (h - DQ(c))          # moving average of compression errors
    e     = Q_8(e_new)                                   # stored in 8 bits, one scale per block

and the optimizer receives the mean over workers of ``DQ(c)``, computed by
the two-stage quantized all-reduce of :mod:`loco_jax.collectives` (all-to-all,
fp32 sum, re-quantize, all-gather).

With ``rotate=True`` the bucket is first mapped by a fixed randomized
Hadamard transform ``R`` (orthogonal, one per bucket, the same on every
device) and the whole step above runs on ``R g``: ``h = R g + e``,
``c = Q_b(h)``, and the result is ``R^T`` of the reduced mean. The error
buffer therefore holds ``R``-domain errors (``R^T e`` is the error in the
gradient's own coordinates). ``format`` picks ``Q_b`` (:mod:`loco_jax.quant`:
``int`` absmax, ``e3m0``, and the ``uniform`` / ``lloyd`` grids that use every
code, fitted to the block's RMS and then by least squares). ``beta = 0`` is plain error feedback
(Seide et al. 2014); ``compensate=False`` is naive low-bit communication;
``bits=None`` is the exact fp32 mean (the baseline). With
``compensate_second_stage=True`` the re-quantization of the reduced chunk is
compensated the same way with a second buffer on that chunk (as LoCo's
DeepSpeed code does).

Residuals, sums and state are fp32 whatever the gradient dtype. The error is
stored in 8 bits and reset every 1024 steps (all buffers at once, where the
reference rolls a per-tensor counter). ``format``, ``rotate``, ``beta``,
``compensate`` and ``compensate_second_stage`` default per bit width to
:data:`MEASURED`, the settings that trained best in ``benchmarks/lowbit.py``
(docs/results.md, "Low-bit quality"); ``preset="reference"`` gives the
authors' reference code's settings (int absmax, beta 0.8, no rotation) at
every width.

Non-finite gradients (docs/algorithms.md, "7. Non-finite values"): a NaN or Inf on any device must not
reach the error buffers and every device must decide alike, so one finite
flag is reduced over every mesh axis (a scalar ``pmin``; inside
:func:`loco_jax.diloco.diloco`, over the devices of one replica, which decides
alone). When it is false the step is skipped on all of them: the state is unchanged except ``skipped``, which
counts such steps, and the updates are zeros (``nonfinite="skip"``) or NaN
(``nonfinite="propagate"``, to let a caller or ``optax.apply_if_finite``
act). To skip the *whole* chain (no Adam moment decay on a skipped step),
wrap it: ``loco.skip_nonfinite(optax.chain(loco.compress(), optax.adamw(...)))``. The flag is agreed over
every bound mesh axis but the ``independent_axes`` a caller passes (:mod:`loco_jax.nonfinite`; DiLoCo passes
its replica axis, so each replica decides alone).

FSDP (``reduce="scatter"``): the input is full-shape local gradients (taken
with respect to the gathered parameters), the output is each leaf's shard of
the mean (``tiled``) on the dimension ``shard_dims`` names for it (default
dim 0; :mod:`loco_jax.fsdp` picks one that is not a scanned stack's layer
axis), in fp32 (or the gradient's dtype if wider), so the next
transformations see shard-shaped updates for shard-shaped parameters.
``init`` receives the shard-shaped parameters and allocates the full-size
error buffer (``error_bits`` per value: this buffer is not sharded). Only the
all-to-all stage runs. The full local gradient exists during the step (it is
the input); ``bucket_size`` bounds the fp32 working copies to one bucket at a
time.

Buckets: the whole tree by default, ``bucket_size`` values at most each, or explicit groups
(``groups=``: one bucket per group number, one per layer of a scanned stack). The per-bucket step is an
:class:`Exchanger`'s (:func:`exchanger`), which :mod:`loco_jax.backward` also runs inside the backward pass,
as each layer's gradient is produced; ``update(means, state, params, exchanged=candidate)`` then only
decides and commits, and the two paths give bit-identical results.

The shard_map recipe: see the README. In short, ``init`` and ``update`` run
inside ``shard_map``; with ``check_vma=True`` cast replicated parameters to
varying over the data axes before ``jax.grad`` (``jax.lax.pcast(p, axes,
to="varying")``), else JAX inserts an exact fp32 psum of the gradient and
there is nothing left to compress (``update`` detects this and raises).
:func:`state_specs` gives the ``PartitionSpec`` of every state leaf.

Reference: Xie et al., "LoCo: Low-Bit Communication Adaptor for Large-scale
Model Training", arXiv 2407.04480 (TPAMI 2025), Algorithm 1; docs/algorithms.md, "4. LoCo error compensation".

Why one module of this size: ``compress`` and its in-backward ``exchanger`` share one per-bucket
step (bucket, send, exchange, receive) that must stay bit-identical between the two paths; the
bucketing (:func:`bucket_layout`) is a module-level piece of its own, and the payload and its error step
are the codec's (:mod:`loco_jax.exchange`, shared with DiLoCo's outer exchange).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Literal, NamedTuple, get_args

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from loco_jax import collectives as coll
from loco_jax import exchange as exchange_lib
from loco_jax import quant, specs
from loco_jax.checks import is_int, require_int
from loco_jax import nonfinite
from loco_jax.nonfinite import INDEPENDENT, all_finite, decision_axes, select

Reduce = Literal["mean", "scatter"]
NonFinite = Literal["skip", "propagate"]
REDUCE_MODES = get_args(Reduce)
NONFINITE_MODES = get_args(NonFinite)
# part of this module's API: loco.skip_nonfinite(optax.chain(loco.compress(), optax.adamw(...)))
skip_nonfinite = nonfinite.skip_nonfinite
PRESETS = exchange_lib.PRESETS

# LoCo's reference settings (the authors' code): absmax int payloads, beta 0.8, no rotation, no
# second-stage buffer. ``preset="reference"`` gives these at every bit width.
REFERENCE = dict(format="int", rotate=False, beta=0.8, compensate=True, compensate_second_stage=False)

# What ``compress(bits=b)`` uses when these arguments are left at None: per bit width, the setting that
# measured best on real training at the two-stage, block-256 wire budget; the tables it was chosen from
# are docs/results.md, "Low-bit quality: formats, rotation, compensation" (seed 0) and "The defaults on
# fresh seeds 1-3". 8 bits was not measured and keeps the reference. bits=None (the exact mean) ignores them.
# 4 and 2 bits compress without compensation since 2026-12-04: on seeds 1-2 of two texts (Shakespeare and a
# second one), naive in the default's format beat the compensated default on the mean of each text
# (docs/results.md, "The per-bit defaults on a second text"); compensate=True (with beta) brings it back.
MEASURED = {
    8: dict(REFERENCE),
    4: dict(format="lloyd", rotate=True, beta=0.0, compensate=False, compensate_second_stage=False),
    2: dict(format="lloyd", rotate=True, beta=0.8, compensate=False, compensate_second_stage=False),
    1: dict(format="int", rotate=True, beta=0.8, compensate=False, compensate_second_stage=False),
}
SETTING_NAMES = tuple(REFERENCE)


def settings(bits, preset="measured", **given):
    """The resolved compression settings for ``bits``: ``given`` values that are not None, else the preset's.

    ``preset="measured"``: :data:`MEASURED` (the per-bit defaults); ``"reference"``: :data:`REFERENCE`.
    """
    return exchange_lib.preset_settings(bits, preset, given, reference=REFERENCE, measured=MEASURED, what="LoCo")


def settings_of(fields) -> dict:
    """:func:`settings` of a mapping of ``compress``'s arguments (a config's section): its ``bits``,
    ``preset`` and :data:`SETTING_NAMES`; other keys are not read."""
    return settings(fields["bits"], fields.get("preset", "measured"), **{n: fields.get(n) for n in SETTING_NAMES})


class CompressState(NamedTuple):
    """State of :func:`compress`; one entry of the error tuples per bucket.

    ``error[i]``: stored stage-1 error of bucket ``i``, ``(M, cols)``, ``uint8``
    codes when ``error_bits`` is set (with fp32 block scales in
    ``error_scale[i]``) or fp32. ``error2`` / ``error2_scale``: the
    second-stage error on this device's reduced chunk, ``(1, cols)``. All
    error buffers differ per device.
    """

    count: jax.Array  # int32 []: completed steps (t - 1 inside update)
    skipped: jax.Array  # int32 []: steps skipped for non-finite gradients
    key: jax.Array  # uint32 [2]: stochastic-rounding key, advanced every step
    error: tuple = ()
    error_scale: tuple = ()
    error2: tuple = ()
    error2_scale: tuple = ()


SLOT_FIELDS = ("error", "error_scale", "error2", "error2_scale")  # one bucket's buffers: its "slot"
STACK = "stack"  # the bucket label of a scanned stack's leaves (compress(groups=...))


class StepInputs(NamedTuple):
    """What an update needs besides the gradients (:meth:`Exchanger.step_inputs`)."""

    t: jax.Array  # int32 []: this step's number, 1 at the first update
    reset: jax.Array  # bool []: the error buffers are zeroed this step
    key: Any  # this step's stochastic-rounding key
    next_key: Any  # the key the state keeps for the next step


class Exchanger(NamedTuple):
    """What :func:`compress` is made of, for the in-backward exchange (:mod:`loco_jax.backward`).

    ``transformation``: the optax transformation (``compress(...)`` itself). ``layout(shapes, dims,
    labels, m)``: the buckets of full gradients of these shapes. ``bucket(b, leaves, dims, slot, inputs,
    axes)``: one bucket's step, ``(outputs, new slot)``; where ``pipelined``, the same as ``receive(b,
    exchange(payload), layout, slot, inputs, axes)`` after ``payload, layout, slot = send(b, leaves, dims,
    slot, inputs, axes)``, so the all-to-all can be issued apart from its two local halves.
    ``step_inputs(state)``: :class:`StepInputs`.
    ``slot_of(state, b)``: bucket ``b``'s error buffers. ``labels_of(treedef, n)``: the ``groups`` labels.
    """

    transformation: optax.GradientTransformationExtraArgs
    layout: Any
    bucket: Any
    pipelined: bool  # bucket = receive(exchange(send(...))): the step splits at its all-to-all
    send: Any
    exchange: Any
    receive: Any
    step_inputs: Any
    slot_of: Any
    labels_of: Any
    axis_name: str | None
    codec: Any  # the exchange value (loco_jax.exchange.Dense or Exact) the step runs


def stored(slots) -> dict:
    """The error-buffer fields of a :class:`CompressState` from every bucket's slot, in bucket order (the
    fields this configuration keeps)."""
    return {f: tuple(slot[k] for slot in slots) for k, f in enumerate(SLOT_FIELDS)
            if slots and slots[0][k] is not None}


def _check_args(codec_value, reduce, mode, reset_every, nonfinite, bucket_size, axis_name, fast_axis, shard_dims):
    """``compress``'s own arguments (where and how the codec's payload travels), each refusal naming one."""
    require_int("reset_every", reset_every, "a positive integer number of steps, or None", allow_none=True)
    if reduce not in REDUCE_MODES:
        raise ValueError(f"reduce={reduce!r} is unknown; choose one of {REDUCE_MODES}.")
    if mode not in coll.MODES:
        raise ValueError(f"mode={mode!r} is unknown; choose one of {coll.MODES}.")
    if reduce == "scatter" and mode != "two_stage":
        raise ValueError("reduce='scatter' runs only the all-to-all stage; it needs mode='two_stage'.")
    if nonfinite not in NONFINITE_MODES:
        raise ValueError(f"nonfinite={nonfinite!r} is unknown; choose one of {NONFINITE_MODES}.")
    require_int("bucket_size", bucket_size, "a positive number of values, or None (one bucket)", allow_none=True)
    if codec_value.compensate_second_stage and (not codec_value.compensate or mode != "two_stage"
                                                or reduce != "mean"):
        raise ValueError(
            "compensate_second_stage=True needs the two-stage all-reduce with compensation: "
            "bits set, compensate=True, mode='two_stage' and reduce='mean'."
        )
    if fast_axis is not None:
        if fast_axis == axis_name or axis_name is None:
            raise ValueError(
                f"fast_axis={fast_axis!r} must be a mesh axis other than axis_name={axis_name!r} (the slow links "
                "LoCo compresses); the mean over both is what the optimizer gets."
            )
        if reduce != "mean":
            raise ValueError(
                f"fast_axis={fast_axis!r} does not combine with reduce={reduce!r}: the hierarchical all-reduce gathers "
                "the whole mean back over the fast axis; for FSDP shards use reduce='scatter' over one axis."
            )
    if shard_dims is not None and reduce != "scatter":
        raise ValueError(f"shard_dims is for reduce='scatter' (FSDP); reduce={reduce!r} returns full-shape means.")


def state_axes(leaves, axis_name):
    """The mesh axes per-device state varies over: ``axis_name`` and every axis the leaves vary over."""
    varying = set().union(*(specs.varying_axes(x) for x in leaves)) if leaves else set()
    return tuple(a for a in specs.manual_axes() if a == axis_name or a in varying)


def _check_grads_vary(leaves, axis_name):
    """The silent-psum trap: under check_vma, gradients must vary over ``axis_name``."""
    if axis_name is None or not specs.check_vma_enabled(axis_name):
        return
    for leaf in leaves:
        if axis_name not in specs.varying_axes(leaf):
            raise ValueError(
                f"loco.compress: a gradient of shape {leaf.shape} is not varying over axis {axis_name!r}, so JAX "
                "has already summed it in fp32 (the transpose of the implicit cast of replicated parameters "
                "to varying) and there is nothing left to compress. Cast the parameters to varying before "
                f"taking the gradient: jax.lax.pcast(params, {axis_name!r}, to='varying'), or run the "
                "shard_map with check_vma=False. See the README's shard_map recipe."
            )


def compress(
    bits: int | None | exchange_lib.Dense | exchange_lib.Exact = 4,
    *,
    axis_name: str | None = "data",
    reduce: Reduce = "mean",
    mode: coll.Mode = "two_stage",
    reset_every: int | None = 1024,
    nonfinite: NonFinite = "skip",
    bucket_size: int | None = None,
    groups=None,
    shard_dims=None,
    fast_axis: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """LoCo: averages gradients over ``axis_name`` in ``bits`` bits, compensating the error.

    What is sent is the codec's (:func:`codec`, a value of :mod:`loco_jax.exchange`); where and how it
    travels is this function's. ``compress(bits=4)`` runs ``codec(4)``, the per-bit defaults of
    :data:`MEASURED`; any other setting is one value: ``compress(codec(4, compensate=True, beta=0.8))``,
    ``compress(codec(2, preset="reference"))``.

    Args:
      bits: 8, 4, 2 or 1 bits per value on the wire (plus 32 / ``block_size``
        for the scales), the settings :func:`codec` gives those bits; ``None``
        is the exact fp32 mean. Or the exchange itself: :func:`codec`'s value,
        an ``exchange.Dense(...)`` or ``exchange.Exact()``.
      axis_name: mesh axis to average over; ``None`` compresses and
        decompresses locally, with no communication.
      reduce: ``"mean"`` (every device gets the full mean) or ``"scatter"``
        (each device gets its dim-0 shard of the mean, FSDP).
      mode: ``"two_stage"`` (all-to-all then all-gather) or ``"all_gather"``
        (quantize once, gather every payload, sum locally).
      reset_every: zero every error buffer when ``t % reset_every == 0``
        (``None``: never).
      nonfinite: ``"skip"`` (zero updates) or ``"propagate"`` (NaN updates)
        on a step whose gradients hold NaN or Inf anywhere; the state is left
        unchanged either way.
      bucket_size: at most this many values per bucket (whole leaves); ``None``
        sends the whole tree as one bucket.
      groups: how leaves form buckets: ``None`` (leaves in tree order, in
        buckets of at most ``bucket_size`` values), or a pytree with the
        gradients' structure whose leaves are ``None`` (bucketed that way,
        first), an ``int`` (the leaves of one number form one bucket, in
        increasing order of the numbers) or :data:`STACK` (a scanned stack:
        dim 0 is the layer axis and layer ``l``'s slices of every ``STACK``
        leaf form one bucket, ``l = 0 .. L-1``, last; its error buffers are
        stored stacked, ``(L, M, cols)``). One bucket per layer is what the
        in-backward exchange (:mod:`loco_jax.backward`) uses; the two give
        bit-identical results.
      shard_dims: ``reduce="scatter"`` only: a pytree of ints with the
        gradients' structure, the dimension each leaf's shard is cut on
        (``None``: dim 0 of every leaf); see :func:`loco_jax.fsdp.shard_dims`.
      fast_axis: hierarchical LoCo: a mesh axis of fast links (the devices of
        one host). The mean over it is exact (``psum_scatter``: each device
        keeps 1/D of the bucket), the low-bit LoCo all-reduce runs over
        ``axis_name`` on that 1/D shard with its error buffers (1/D the size),
        and an ``all_gather`` over ``fast_axis`` restores the whole mean. Only
        ``uint8`` crosses ``axis_name``. With ``reduce="mean"`` only.

    Returns:
      An ``optax.GradientTransformationExtraArgs``; ``init`` and ``update`` run
      inside ``shard_map`` when ``axis_name`` is set. ``update(means, state,
      params, exchanged=candidate)`` takes gradients already exchanged in the
      backward pass (:mod:`loco_jax.backward`) with their new error buffers,
      and only decides (the non-finite rule) and commits.
    """
    return _build(**locals()).transformation


def exchanger(**kwargs) -> Exchanger:
    """The :class:`Exchanger` of ``compress(**kwargs)`` (the same arguments): its optax transformation and
    the per-bucket step that the in-backward exchange (:mod:`loco_jax.backward`) runs."""
    arguments = inspect.signature(compress).bind(**kwargs)  # refuses an unknown argument by name
    arguments.apply_defaults()  # compress's defaults: the one place they are written
    return _build(**arguments.arguments)


def codec(
    bits: int | None = 4,
    *,
    preset: exchange_lib.Preset = "measured",
    format: quant.Format | None = None,
    rotate: bool | None = None,
    beta: float | None = None,
    compensate: bool | None = None,
    compensate_second_stage: bool | None = None,
    error_bits: int | None = 8,
    block_size: int = quant.DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    stochastic_rounding: bool = False,
) -> exchange_lib.Dense | exchange_lib.Exact:
    """What LoCo sends for ``bits``, as one checked value (:mod:`loco_jax.exchange`): ``compress(bits)``
    runs ``codec(bits)``.

    ``format``, ``rotate``, ``beta``, ``compensate`` and ``compensate_second_stage`` left at ``None`` take
    the per-bit defaults of :data:`MEASURED` (``preset="measured"``) or LoCo's reference settings
    (``preset="reference"``: int absmax, beta 0.8, no rotation); see :func:`settings`. ``codec(4)`` is
    ``Dense(bits=4, format='lloyd', rotate=True, compensate=False, beta=0.0, ...)``; ``codec(None)`` is
    ``Exact()``, the fp32 mean.

    Args:
      bits: 8, 4, 2 or 1 bits per value on the wire, or ``None`` (exact fp32).
      preset: where the ``None`` settings come from: ``"measured"`` or ``"reference"``.
      format: the payload format, one of :data:`quant.FORMATS` (``"int"``
        absmax, ``"e3m0"`` 4-bit float, ``"uniform"`` and ``"lloyd"``
        RMS-fitted grids that use every code).
      rotate: quantize in a randomized-Hadamard domain (one fixed rotation per
        bucket from ``seed``; power-of-two ``block_size``). The sums run on
        rotated values and the mean is rotated back once; the error buffers
        live in the rotated domain (the rotation is orthogonal and fixed, so
        ``R^T e`` is the error in the gradient's own coordinates).
      beta: weight of the old error in the moving average, in [0, 1); 0 is
        plain error feedback.
      compensate: ``False`` is naive low-bit communication (no error state).
      compensate_second_stage: also compensate the re-quantization of the
        reduced chunk (two-stage, ``reduce="mean"``).
      error_bits: bits of the stored error (block scales), ``None`` for fp32.
      block_size: values per scale (a multiple of 8).
      seed: of the rotations and of the stochastic-rounding key.
      stochastic_rounding: unbiased random rounding; the key is in the state,
        folded with each device's index and advanced every step.
    """
    resolved = settings(bits, preset, format=format, rotate=rotate, beta=beta, compensate=compensate,
                        compensate_second_stage=compensate_second_stage)
    if bits is None:  # the exact mean: nothing to compress, nothing to compensate
        if stochastic_rounding:
            raise ValueError("stochastic_rounding=True rounds a quantized payload, but bits=None exchanges exact "
                             "fp32; set bits.")
        return exchange_lib.Exact(block_size).checked(format=resolved["format"], error_bits=error_bits,
                                                      beta=resolved["beta"])
    return exchange_lib.Dense(bits, resolved["format"], resolved["rotate"], block_size, resolved["compensate"],
                              resolved["beta"], error_bits, seed, resolved["compensate_second_stage"],
                              stochastic_rounding).checked()


def bucket_labels(groups, treedef, count):
    """One bucket label per gradient leaf from ``compress(groups=...)``: None (the default buckets), a
    non-negative int (one bucket per number) or :data:`STACK` (one bucket per layer of a scanned stack)."""
    if groups is None:
        return [None] * count
    labels, labels_def = jax.tree.flatten(groups, is_leaf=lambda x: x is None)
    if labels_def != treedef:
        raise ValueError(f"loco.compress: groups has structure {labels_def}, but the gradients have {treedef}; "
                         "give one label per gradient leaf (None, an int, or loco.STACK).")
    for label in labels:
        if not (label is None or label == STACK or (is_int(label) and label >= 0)):
            raise ValueError(f"loco.compress: bucket label {label!r} is not None, a non-negative int or "
                             f"loco.STACK.")
    return labels


def bucket_cols(sizes, m, *, block_size, scatter=False, fast_size=None):
    """Columns of the ``(m, cols)`` rows LoCo quantizes for a bucket of full gradients of these sizes: whole
    blocks, ``round_up(ceil(n / m), B)`` (:func:`loco_jax.collectives.bucket_cols`). Hierarchical
    (``fast_size`` devices on the fast axis): the rows are this device's ``1/D`` shard of the bucket."""
    if fast_size is not None:
        return coll.bucket_cols(sizes, fast_size, block_size, pad_multiple=m) // m
    return coll.bucket_cols(sizes, m, block_size, scatter=scatter)


def split_rows(shape, dim, bucket_size, scatter):
    """Row ranges of dim 0 that cut one leaf into pieces of at most ``bucket_size`` values (scatter, shards off
    dim 0: each piece keeps every device's shard). One range (the whole leaf) otherwise."""
    n0 = shape[0] if shape else 1
    full_size = int(np.prod(shape))
    if not (scatter and bucket_size is not None and dim != 0 and full_size > bucket_size and n0 > 1):
        return [(0, n0)]
    edges = np.linspace(0, n0, min(n0, -(-full_size // bucket_size)) + 1).round().astype(int)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def bucket_layout(shapes, dims, labels, m, *, block_size, bucket_size=None, scatter=False, fast_size=None):
    """The buckets of full gradients of these shapes: ``(flat, stack)``.

    ``flat``: per bucket, ``(pieces, cols)`` with pieces ``(leaf, start, stop)`` (a dim-0 row range: the whole
    leaf unless scatter cut it to ``bucket_size``); unlabelled leaves first, grouped consecutively into
    buckets of at most ``bucket_size`` values, then one bucket per group number. ``stack``: ``(leaves, layers,
    cols)`` of the STACK leaves, or None. Bucket ``b`` of ``flat`` is number ``b``; layer ``l`` of the stack is
    number ``len(flat) + l`` (its rotation and rounding keys). ``dims``: each leaf's shard dimension (scatter).
    """
    cols = functools.partial(bucket_cols, m=m, block_size=block_size, scatter=scatter, fast_size=fast_size)

    def size(shape, a=0, b=None):
        rows = (shape[0] if shape else 1) if b is None else b - a
        return int(np.prod(shape[1:])) * rows if shape else 1

    pieces = [(i, a, b) for i, label in enumerate(labels) if label is None
              for a, b in split_rows(shapes[i], dims[i] if scatter else 0, bucket_size, scatter)]
    sizes = [size(shapes[i], a, b) for i, a, b in pieces]
    flat = [([pieces[k] for k in g], cols([sizes[k] for k in g])) for g in coll.group_leaves(sizes, bucket_size)]
    for number in sorted({label for label in labels if isinstance(label, int)}):
        members = [i for i, label in enumerate(labels) if label == number]
        flat.append(([(i, 0, shapes[i][0] if shapes[i] else 1) for i in members],
                     cols([size(shapes[i]) for i in members])))
    stacked = [i for i, label in enumerate(labels) if label == STACK]
    if not stacked:
        return flat, None
    depths = {shapes[i][0] if shapes[i] else None for i in stacked}
    if len(depths) != 1 or None in depths:
        raise ValueError(f"loco.compress: the STACK leaves must share their layer axis (dim 0); their shapes are "
                         f"{[tuple(shapes[i]) for i in stacked]}.")
    for i in stacked:
        if scatter and dims[i] == 0:
            raise ValueError(f"loco.compress: STACK leaf {i} of shape {tuple(shapes[i])} is sharded on dim 0, "
                             "its layer axis; shard it on another dimension (fsdp.shard_dims does).")
    return flat, (stacked, depths.pop(), cols([int(np.prod(shapes[i][1:])) for i in stacked]))


class BucketAllReduce(NamedTuple):
    """One bucket's LoCo all-reduce over ``axis_name``: compensate, encode, exchange, decode, keep the error
    (the ``codec``'s: :mod:`loco_jax.exchange`), with the collective of ``mode`` (and ``fast_axis``,
    hierarchical; ``scatter``: each device keeps its shard of the mean).

    :meth:`bucket` is the whole step; with the two-stage all-reduce it splits at its all-to-all into
    :meth:`send`, :meth:`exchange` and :meth:`receive`, which the in-backward exchange
    (:mod:`loco_jax.backward`) issues a layer apart.
    """

    axis_name: str | None
    fast_axis: str | None
    scatter: bool
    codec: Any  # exchange.Dense or exchange.Exact: the payload, its error step, the rounding and its seed
    mode: str

    @property
    def cfg(self) -> coll.QuantConfig:
        """The payload's codec (a quantized exchange's)."""
        return self.codec.quant

    @property
    def quantized(self) -> bool:
        return self.codec.bits is not None

    @property
    def stochastic_rounding(self) -> bool:
        return self.codec.stochastic_rounding

    @property
    def compensate_second_stage(self) -> bool:
        return self.codec.compensate_second_stage

    @property
    def feedback(self):
        """The codec's error step (:class:`loco_jax.exchange.ErrorFeedback`), None where no error is kept."""
        return self.codec.feedback

    def _out_dtype(self, dtype):
        # a reduced shard feeds the optimizer of fp32 parameters: never narrower than fp32
        return jnp.promote_types(dtype, jnp.float32) if self.scatter else dtype

    def _exact(self, leaves, m, dims):
        out = []
        for i, leaf in enumerate(leaves):
            g = leaf.astype(jnp.float32)
            if self.scatter:  # XLA:CPU: one reduce-scatter after another (it combines the all-reduces itself)
                g = coll.after(g, out[-1:])
            if self.axis_name is not None:
                mean_axes = self.axis_name if self.fast_axis is None else (self.axis_name, self.fast_axis)
                g = (lax.psum_scatter(g, self.axis_name, scatter_dimension=dims[i], tiled=True) / m if self.scatter
                     else lax.pmean(g, mean_axes))
            out.append(g.astype(self._out_dtype(leaf.dtype)))
        return out

    def _compensated(self, b, rows, slot, inputs):
        """``(h, e)``: the rows rotated (identity unless rotate; errors live in this domain) plus the stored
        stage-1 error (zero on a reset step; ``e`` None where none is kept)."""
        rows = self.cfg.rotate_in(rows, b)
        if self.feedback is None:
            return rows, None
        e = self.feedback.load(slot[0], slot[1], inputs.reset)
        return self.feedback.compensate(rows, e), e

    def _stored(self, e, h, sent, slot, inputs):
        """The slot with its new stage-1 error: the moving average of the compression errors ``h - sent``."""
        if self.feedback is None:
            return slot
        return self.feedback.update(e, h, sent, never=inputs.t < 0) + tuple(slot[2:])

    def pipelined(self):
        """True where a bucket's step splits at its all-to-all (:func:`send`, the collective, :func:`receive`):
        the two-stage all-reduce or the reduce-scatter, without a fast axis."""
        return self.quantized and self.mode == "two_stage" and self.fast_axis is None

    def send(self, b, leaves, dims, slot, inputs, axes):
        """Stage one up to its all-to-all: ``(payload, layout, slot)``, the ``uint8`` payload of the compensated
        rows (row ``j`` goes to device ``j``), the bucket layout, and the slot with its new stage-1 error."""
        rows, layout_ = coll.make_bucket(leaves, coll.axis_size(self.axis_name), self.cfg.block_size,
                                         scatter=self.scatter, dims=dims)
        key1 = coll.device_key(inputs.key, axes, 2 * b) if self.stochastic_rounding else None
        h, e = self._compensated(b, rows, slot, inputs)
        payload = self.cfg.encode(h, key1)
        return payload, layout_, self._stored(e, h, self.cfg.decode(payload, h.shape[1]), slot, inputs)

    def exchange(self, payload):
        """The all-to-all of a :func:`send` payload (nothing without an axis)."""
        return payload if self.axis_name is None else lax.all_to_all(payload, self.axis_name, 0, 0, tiled=True)

    def receive(self, b, received, layout_, slot, inputs, axes):
        """The rest of the step from the received payloads: ``(outputs, slot)``: this device's chunk of the
        sum, then its shard (scatter) or the second stage (the all-gather of the re-quantized chunks)."""
        m = coll.axis_size(self.axis_name)
        chunk = self.cfg.decode(received, layout_.cols).sum(axis=0) / m
        if self.scatter:
            shard = coll.unbucket_shard(self.cfg.rotate_out(chunk[None], b)[0], layout_)
            return [leaf.astype(self._out_dtype(d)) for d, leaf in zip(layout_.dtypes, jax.tree.leaves(shard))], slot
        mean_rows, slot = self._second_stage(b, chunk, slot, inputs, axes)
        return jax.tree.leaves(coll.unbucket(self.cfg.rotate_out(mean_rows, b), layout_)), slot

    def _second_stage(self, b, chunk, slot, inputs, axes):
        """``(mean rows, slot)``: this device's chunk of the mean re-quantized (compensated with the
        second-stage error where kept) and all-gathered."""
        key2 = coll.device_key(inputs.key, axes, 2 * b + 1) if self.stochastic_rounding else None
        if not self.compensate_second_stage:
            return coll.all_gather_chunk(chunk, self.axis_name, self.cfg, key2)[0], slot
        e2 = self.feedback.load(slot[2], slot[3], inputs.reset)
        h2 = self.feedback.compensate(chunk[None], e2)
        mean_rows, sent2 = coll.all_gather_chunk(h2[0], self.axis_name, self.cfg, key2)
        return mean_rows, tuple(slot[:2]) + self.feedback.update(e2, h2, sent2[None], never=inputs.t < 0)

    def bucket(self, b, leaves, dims, slot, inputs, axes):
        """One bucket's LoCo step: ``(outputs, new slot)``.

        ``leaves``: full local gradients (any float dtype); ``dims``: their shard dimensions (scatter);
        ``slot``: the bucket's ``(error, error_scale, error2, error2_scale)`` (None where not kept); ``b``:
        the bucket's number (a traced int for the layers of a stack); ``axes``: the axes whose devices
        draw independent rounding noise. Outputs: the mean (``reduce="mean"``) or this device's shard of it.
        """
        m = coll.axis_size(self.axis_name)
        if not self.quantized:
            return self._exact(leaves, m, dims), slot
        if self.pipelined():
            payload, layout_, slot = self.send(b, leaves, dims, slot, inputs, axes)
            return self.receive(b, self.exchange(payload), layout_, slot, inputs, axes)
        # the all-gather form, or hierarchical: exact over the fast axis first, this device's 1/D shard as (m, cols)
        if self.fast_axis is None:
            rows, layout_ = coll.make_bucket(leaves, m, self.cfg.block_size, scatter=self.scatter, dims=dims)
        else:
            rows, layout_ = coll.fast_shard(leaves, self.fast_axis, m, self.cfg.block_size, mean=True)
        key1 = coll.device_key(inputs.key, axes, 2 * b) if self.stochastic_rounding else None
        h, e = self._compensated(b, rows, slot, inputs)
        if self.mode == "all_gather":  # (reduce="scatter" needs the two-stage form: refused above)
            total, sent = coll.all_gather_sum(h, self.axis_name, self.cfg, key1)
            mean_rows = total / m
            slot = self._stored(e, h, sent, slot, inputs)
        else:
            chunk, sent = coll.reduce_scatter_rows(h, self.axis_name, self.cfg, key1)
            slot = self._stored(e, h, sent, slot, inputs)
            mean_rows, slot = self._second_stage(b, chunk / m, slot, inputs, axes)
        mean_rows = self.cfg.rotate_out(mean_rows, b)
        if self.fast_axis is not None:  # every fast device's shard of the mean, back to the whole bucket
            mean_rows = coll.fast_gather(mean_rows, self.fast_axis)
        return jax.tree.leaves(coll.unbucket(mean_rows, layout_)), slot


class BucketStep(NamedTuple):
    """:func:`compress`'s transformation over a gradient tree: its buckets (:meth:`layout`, :meth:`labels_of`),
    the error buffers they keep (:meth:`init`, :meth:`slot_of`), each step's inputs (:meth:`step_inputs`),
    every bucket's exchange in turn (``allreduce``, a :class:`BucketAllReduce`) and the non-finite rule's
    decision and commit (:meth:`update`).
    """

    allreduce: BucketAllReduce
    bucket_size: int | None
    reset_every: int | None
    shard_dims: Any
    nonfinite: str
    groups: Any  # compress(groups=); the quantizer's block size is the codec's

    # where the buckets go, as the all-reduce sends them
    axis_name = property(lambda self: self.allreduce.axis_name)
    fast_axis = property(lambda self: self.allreduce.fast_axis)
    scatter = property(lambda self: self.allreduce.scatter)

    def layout(self, shapes, dims, labels, m):
        """:func:`bucket_layout` with this transformation's settings (``m``: devices on ``axis_name``)."""
        fast_size = coll.axis_size(self.fast_axis) if self.fast_axis is not None else None
        return bucket_layout(shapes, dims, labels, m, block_size=self.allreduce.codec.block_size,
                             bucket_size=self.bucket_size, scatter=self.scatter, fast_size=fast_size)

    def labels_of(self, treedef, count):
        """The ``groups`` labels of a tree (:func:`bucket_labels`)."""
        return bucket_labels(self.groups, treedef, count)

    def _init_dims(self, params):
        if not self.scatter or self.shard_dims is None:
            return [0] * len(jax.tree.leaves(params))
        return [int(d) for d in jax.tree.leaves(self.shard_dims)]

    def init(self, params):
        if self.axis_name is not None:
            specs.require_axis(self.axis_name, "loco.compress")
        if self.fast_axis is not None:
            specs.require_axis(self.fast_axis, "loco.compress")
        count = jnp.zeros((), jnp.int32)
        key = jax.random.key_data(jax.random.PRNGKey(self.allreduce.codec.seed))
        if self.allreduce.feedback is None:
            return CompressState(count, count, key)
        m = coll.axis_size(self.axis_name)
        leaves, treedef = jax.tree.flatten(params)
        # The error buffers vary as the gradients will: over axis_name and over every axis the
        # parameters vary over (e.g. DiLoCo's replica axis), so the updates keep the parameters' type.
        device_axes = state_axes(leaves, self.axis_name)
        if self.fast_axis is not None:  # hierarchical: each fast device keeps the errors of its own shard
            device_axes = tuple(a for a in specs.manual_axes() if a in device_axes or a == self.fast_axis)

        def zeros(shape, depth=None):
            values, scales = self.allreduce.feedback.zeros(shape)
            if depth is not None:
                values, scales = jax.tree.map(lambda x: jnp.broadcast_to(x, (depth,) + x.shape), (values, scales))
            return jax.tree.map(lambda x: specs.to_varying(x, device_axes), (values, scales))

        dims = self._init_dims(params)
        shapes = [tuple(leaf.shape) for leaf in leaves]
        if self.scatter:  # init receives shards: the full gradients are m times bigger on their shard dimension
            shapes = [tuple(n * m if k == d else n for k, n in enumerate(s)) for s, d in zip(shapes, dims)]
        flat, stack = self.layout(shapes, dims, self.labels_of(treedef, len(leaves)), m)
        buffers = [(cols, None) for _, cols in flat] + ([(stack[2], stack[1])] if stack else [])
        error, error_scale, error2, error2_scale = [], [], [], []
        for cols, depth in buffers:
            values, scales = zeros((m, cols), depth)
            error.append(values)
            error_scale.append(scales)
            if self.allreduce.compensate_second_stage:
                values, scales = zeros((1, cols), depth)
                error2.append(values)
                error2_scale.append(scales)
        return CompressState(count, count, key, tuple(error), tuple(error_scale), tuple(error2), tuple(error2_scale))

    def _dims(self, treedef, leaves, params, m):
        """Per leaf, the dimension its shard is cut on (scatter), checked against the gradients and params."""
        if self.shard_dims is None:
            dims = [0] * len(leaves)
        else:
            dims_leaves, dims_def = jax.tree.flatten(self.shard_dims)
            if dims_def != treedef:
                raise ValueError(
                    f"loco.compress: shard_dims has structure {dims_def}, but the gradients have {treedef}; give one "
                    "int per gradient leaf."
                )
            dims = [int(d) for d in dims_leaves]
        param_leaves = None if params is None else jax.tree.leaves(params)
        flat_with_paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(treedef, leaves))[0]
        paths = [jax.tree_util.keystr(p) for p, _ in flat_with_paths]
        for i, (leaf, dim) in enumerate(zip(leaves, dims)):
            if leaf.ndim == 0 or not 0 <= dim < leaf.ndim or leaf.shape[dim] % m:
                raise ValueError(
                    f"loco.compress(reduce='scatter'): gradient {paths[i]} of shape {leaf.shape} is sharded on dim "
                    f"{dim} over {m} devices of {self.axis_name!r}; that dimension must exist and be a multiple of {m}."
                )
            want = coll.shard_shape(leaf.shape, dim, m)
            if param_leaves is not None and tuple(param_leaves[i].shape) != want:
                raise ValueError(
                    f"loco.compress(reduce='scatter'): parameter {paths[i]} has shape {param_leaves[i].shape}, but the "
                    f"gradient {leaf.shape} sharded on dim {dim} over {m} devices gives {want}; pass the shard-shaped "
                    "parameters and the shard_dims they were cut with."
                )
        return dims

    def step_inputs(self, state) -> StepInputs:
        """What one update needs besides the gradients: ``t``, whether the errors reset, the step's rounding key."""
        t = state.count + 1
        reset = jnp.array(False) if self.reset_every is None else (t % self.reset_every == 0)
        step_key, next_key = jax.random.split(jax.random.wrap_key_data(state.key))
        return StepInputs(t, reset, step_key, next_key)

    def slot_of(self, state, b):
        """Bucket ``b``'s error buffers in ``state`` (None where this configuration keeps none)."""
        def entry(field):
            values = getattr(state, field)
            return values[b] if b < len(values) else None
        return tuple(entry(f) for f in SLOT_FIELDS)

    def _exchange(self, leaves, dims, labels, state, inputs):
        """Every bucket of the gradients, in order: the outputs per leaf and the new error buffers."""
        m = coll.axis_size(self.axis_name)
        flat, stack = self.layout([tuple(leaf.shape) for leaf in leaves], dims, labels, m)
        axes = state_axes(leaves, self.axis_name)  # noise independent wherever gradients differ (DiLoCo replicas too)
        pieces = [[] for _ in leaves]
        slots = []
        previous = None
        for b, (members, _) in enumerate(flat):
            group = [leaves[i] if (a, z) == (0, leaves[i].shape[0] if leaves[i].ndim else 1) else leaves[i][a:z]
                     for i, a, z in members]
            if self.bucket_size is not None and previous is not None:
                # one bucket at a time: its inputs are taken only once the previous bucket's result exists,
                # so the fp32 working copies (conversions, transposes, rotations) of two buckets never coexist
                group = coll.after(group, previous)
            outs, slot = self.allreduce.bucket(b, group, [dims[i] for i, _, _ in members] if self.scatter else None,
                                self.slot_of(state, b), inputs, axes)
            for (i, _, _), out in zip(members, outs):
                pieces[i].append(out)
            slots.append(slot)
            previous = outs
        out_leaves = [p[0] if len(p) == 1 else jnp.concatenate(p, axis=0) if p else None for p in pieces]
        if stack is not None:
            stacked, depth, _ = stack
            base = len(flat)
            layer_dims = [dims[i] - 1 for i in stacked] if self.scatter else None

            def layer(_, xs):
                layer_leaves, slot, index = xs
                return None, self.allreduce.bucket(base + index, layer_leaves, layer_dims, slot, inputs, axes)

            _, (outs, slot) = lax.scan(layer, None, ([leaves[i] for i in stacked], self.slot_of(state, base),
                                                     jnp.arange(depth, dtype=jnp.int32)))
            for i, out in zip(stacked, outs):
                out_leaves[i] = out
            slots.append(slot)
        return out_leaves, stored(slots)

    def update(self, updates, state, params=None, *, exchanged=None, **extra):
        # of the arguments for the chain's transformations, LoCo reads the axes its caller decides alone over
        agreed_over = decision_axes(extra.get(INDEPENDENT, ()))
        leaves, treedef = jax.tree.flatten(updates)
        for leaf in leaves:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ValueError(
                    f"loco.compress needs floating-point gradients, got dtype {leaf.dtype} (shape {leaf.shape})."
                )
        if self.axis_name is not None:
            specs.require_axis(self.axis_name, "loco.compress")
        if self.fast_axis is not None:
            specs.require_axis(self.fast_axis, "loco.compress")
        inputs = self.step_inputs(state)
        if exchanged is None:
            if self.axis_name is not None:
                _check_grads_vary(leaves, self.axis_name)
            if self.fast_axis is not None:
                _check_grads_vary(leaves, self.fast_axis)
            m = coll.axis_size(self.axis_name)
            dims = self._dims(treedef, leaves, params, m) if self.scatter else None
            out_leaves, new = self._exchange(leaves, dims, self.labels_of(treedef, len(leaves)), state, inputs)
        else:  # exchanged in the backward pass (loco_jax.backward): the updates are the means already
            out_leaves = leaves
            new = {f: getattr(exchanged, f) for f in SLOT_FIELDS if getattr(exchanged, f)}
        # A NaN or Inf anywhere in any device's gradient reaches some device's output (sums and decoded blocks
        # propagate it), so the outputs decide: with reduce="scatter" a pass over shards, not full gradients.
        ok = all_finite(out_leaves, agreed_over)
        fill = 0.0 if self.nonfinite == "skip" else jnp.nan
        out_leaves = [jnp.where(ok, o, jnp.asarray(fill, o.dtype)) for o in out_leaves]
        candidate = state._replace(count=inputs.t, key=jax.random.key_data(inputs.next_key), **new)
        new_state = select(ok, candidate, state)._replace(skipped=state.skipped + (~ok).astype(jnp.int32))
        return jax.tree.unflatten(treedef, out_leaves), new_state


def _build(bits, *, axis_name, reduce, mode, reset_every, nonfinite, bucket_size, groups, shard_dims,
           fast_axis) -> Exchanger:
    """The Exchanger of ``compress``'s arguments, every one given (:func:`exchanger` fills compress's defaults)."""
    value = _codec_value(bits)
    _check_args(value, reduce, mode, reset_every, nonfinite, bucket_size, axis_name, fast_axis, shard_dims)
    allreduce = BucketAllReduce(axis_name, fast_axis, reduce == "scatter", value, mode)
    step = BucketStep(allreduce, bucket_size, reset_every, shard_dims, nonfinite, groups)
    return Exchanger(
        transformation=optax.GradientTransformationExtraArgs(step.init, step.update), layout=step.layout,
        bucket=allreduce.bucket, pipelined=allreduce.pipelined(), send=allreduce.send, exchange=allreduce.exchange,
        receive=allreduce.receive,
        step_inputs=step.step_inputs, slot_of=step.slot_of, labels_of=step.labels_of, axis_name=axis_name,
        codec=value,
    )


def _codec_value(bits):
    """``compress``'s ``bits`` as a checked exchange value: an int or None through :func:`codec`, a value as
    it is (checked as :func:`codec` checks what it builds)."""
    if isinstance(bits, exchange_lib.Sparse):
        raise ValueError(f"loco.compress({bits!r}): LoCo's all-reduce sends dense payloads; use loco.codec(...), "
                         "exchange.Dense or exchange.Exact (a sparse exchange is diloco.diloco's).")
    if isinstance(bits, (exchange_lib.Dense, exchange_lib.Exact)):
        return bits.checked()
    if bits is not None and not is_int(bits):
        raise ValueError(f"loco.compress(bits={bits!r}): bits is 8, 4, 2 or 1, None (the exact fp32 mean), or an "
                         "exchange value (loco.codec(...)).")
    return codec(bits)


def find_state(opt_state) -> CompressState:
    """The one :class:`CompressState` in an optimizer state (a chain's, or inside DiLoCo's, whose scalars are
    stored with shape ``(1,)``: returned as scalars). Raises if there is not exactly one."""
    nodes = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, CompressState))
             if isinstance(x, CompressState)]
    if len(nodes) != 1:
        raise ValueError(f"expected one loco.compress state in the optimizer state, found {len(nodes)}.")
    state = nodes[0]
    scalar = lambda x: x.reshape(()) if hasattr(x, "reshape") else x  # (abstract states stay as they are)
    return state._replace(count=scalar(state.count), skipped=scalar(state.skipped))


def error_rms(state, block_size: int = quant.DEFAULT_BLOCK_SIZE, error_bits: int | None = 8):
    """Root-mean-square of every stored LoCo error in an optax state (a diagnostic).

    Call inside ``shard_map``: finds the :class:`CompressState` nodes of the
    tree, decodes their error buffers and averages the squares over every
    device. Compare it with the gradient's RMS to see how much of the signal
    the compensation carries. 0 when nothing is stored.
    """
    total, count = jnp.zeros((), jnp.float32), 0
    nodes = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, CompressState))
    for node in nodes:
        if not isinstance(node, CompressState):
            continue
        for values, scales in zip(node.error + node.error2, node.error_scale + node.error2_scale):
            bits = error_bits if scales is not None else None
            flat = lambda x: None if x is None else x.reshape(-1, x.shape[-1])  # a stack's (L, M, cols) as rows
            e = quant.load(flat(values), flat(scales), bits, block_size=block_size)
            total, count = total + jnp.sum(e * e), count + e.size
    mean = total / max(count, 1)
    axes = specs.manual_axes()
    if axes:
        mean = lax.pmean(specs.to_varying(mean, axes), axes)
    return jnp.sqrt(mean)


# --------------------------------------------------------------------------
# PartitionSpecs of the state (for shard_map out_specs and checkpoints)


def state_specs(tx: optax.GradientTransformation, params, mesh, in_specs=P()):
    """``PartitionSpec`` of every leaf of ``tx.init(params)`` run inside ``shard_map`` on ``mesh``.

    Error buffers are per device (split on dim 0 over every mesh axis);
    counters, keys and the state of an optimizer on replicated parameters are
    ``P()``. ``in_specs`` is how ``params`` enter the ``shard_map`` (e.g.
    ``P("data")`` for FSDP shards). Works for any chain that holds
    :func:`compress`; see :mod:`loco_jax.specs`.
    """
    return specs.output_specs(tx.init, params, mesh=mesh, in_specs=(in_specs,))
