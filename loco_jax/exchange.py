"""The project's one idea as a value: compress, exchange, decode, keep the error.

A value ``x`` (a gradient, an outer gradient) crosses a slow link as a small payload, and what the payload
loses is kept and sent later (docs/algorithms.md, "4. LoCo error compensation" and "6. DiLoCo and
Streaming DiLoCo")::

    h     = x + c e                                  compensate: the stored error, carried at weight c
    p     = Q(h)                                     encode: the uint8 payload that crosses the link
    sent  = DQ(p)                                    decode: what every receiver reads of h
    e_new = Q_e( a e + (1 - a)(h - sent) )           keep the error: a moving average of what was lost

The same four lines run at two time scales. :func:`loco_jax.loco.compress` runs them every step on the
gradients inside a replica (over the data axis: ``c = 1``, ``a`` = LoCo's ``beta``; 0 is plain error
feedback). :func:`loco_jax.diloco.diloco` runs them every round on each fragment's outer gradient across
replicas (``c = 1``, ``a`` = ``error_beta`` dense; ``c`` = the accumulator's decay, ``a = 0`` sparse,
SparseLoCo's ``e <- decay e + Delta``, then ``e <- e - sent``). Which collective moves ``p`` (a two-stage
all-reduce, an all-gather) is the caller's; the codec and the error step are these values':

- :class:`Exact`: the fp32 mean; nothing encoded, nothing kept.
- :class:`Dense`: every value at ``bits`` (:mod:`loco_jax.quant`: block scales, formats, an optional
  randomized-Hadamard rotation), the error compensated when ``compensate``.
- :class:`Sparse`: each chunk's top ``density`` share of entries at ``bits`` (:mod:`loco_jax.sparse`),
  always compensated (what is not sent is held back, not dropped).

Each has a ``feedback``: its :class:`ErrorFeedback` (the error step above), or None where nothing is kept.
"""

from __future__ import annotations

import inspect
import math
from typing import Literal, NamedTuple, get_args

import jax.numpy as jnp

from loco_jax import collectives as coll
from loco_jax import quant
from loco_jax import sparse as sparse_lib
from loco_jax.checks import is_int

AVERAGE_OVER = ("senders", "replicas")  # a sparse mean's divisor (Sparse.average_over)
CHUNKS = ("flat", "leaves")  # a sparse exchange's chunks (Sparse.chunks)
# The kept values' format per bit width when ``Sparse.of(format=None)``: the top-k entries of a chunk all lie
# far from zero, so a format with a zero level wastes one (docs/results.md, "Sparse outer gradients").
SPARSE_FORMATS = {1: "int", 2: "uniform", 4: "int", 8: "int"}


# Where the settings a caller leaves at None come from: the per-bit table measured best, or the
# authors' reference code's (each algorithm keeps its own tables: loco.MEASURED, diloco.MEASURED).
Preset = Literal["measured", "reference"]
PRESETS = get_args(Preset)


def preset_settings(bits, preset, given, *, reference, measured, what):
    """Compression settings for ``bits``: each of ``given`` that is not None, else the preset's value.

    ``reference`` is one dict of settings for every width; ``measured`` maps a bit width to its dict
    (widths it lacks, and ``bits=None``, take the reference). Used by ``loco.settings`` (each
    step's exchange) and ``diloco.settings`` (each round's); ``what`` names the caller's settings in errors.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is unknown; choose one of {PRESETS}.")
    unknown = set(given) - set(reference)
    if unknown:
        raise ValueError(f"unknown {what} setting(s) {sorted(unknown)}; the settings are {tuple(reference)}.")
    base = reference if preset == "reference" or bits not in measured else measured[bits]
    return {k: (given[k] if given.get(k) is not None else base[k]) for k in reference}


def rounded_apart(x, never):
    """``x``, rounded as its own operation: a select on ``never`` (a flag that is always false but that the
    compiler cannot fold) stands between ``x`` and whatever consumes it.

    XLA:CPU contracts a product and a sum that share a fusion into one fused multiply-add, and whether it
    does depends on how the rest of the program is fused: the same error buffers came out one rounding
    apart from ``compress`` and from the in-backward exchange (a decoded payload ``code * scale``
    subtracted from the compensated gradient, the two products of the moving average). With the select,
    every program rounds the product first.
    """
    return jnp.where(never, jnp.zeros((), x.dtype), x)


class ErrorFeedback(NamedTuple):
    """The error step, written once (the module's docstring)::

        h = x + carry e,    e_new = Q_e( average e + (1 - average)(h - sent) )

    ``carry = None`` (``e`` added whole, ``c = 1``) and ``average = beta`` is LoCo's (``beta = 0``: plain
    error feedback, Seide et al. 2014); ``carry = decay`` (a number, 1 included: the product ``decay e`` is
    rounded on its own before the sum) and ``average = 0`` is the sparse accumulator's. ``Q_e`` keeps the
    error at ``bits`` with one scale per ``block_size`` values (:func:`loco_jax.quant.store`; None: fp32).
    ``never``: a traced flag that is always false, for programs that must round alike (:func:`rounded_apart`).
    """

    carry: float | None = None
    average: float = 0.0
    bits: int | None = 8
    block_size: int = quant.DEFAULT_BLOCK_SIZE

    def zeros(self, shape):
        """The stored form of a zero error of ``shape`` ``(rows, cols)``: ``(values, scales)``."""
        return quant.stored_zeros(shape, self.bits, block_size=self.block_size)

    def load(self, values, scales, reset=None):
        """The fp32 error of a stored one; zero where ``reset`` (a traced flag) is set."""
        e = quant.load(values, scales, self.bits, block_size=self.block_size)
        return e if reset is None else jnp.where(reset, 0.0, e)

    def compensate(self, x, e, never=False):
        """``h = x + carry e``."""
        return x + e if self.carry is None else rounded_apart(self.carry * e, never) + x

    def update(self, e, h, sent, never=False):
        """The stored new error ``(values, scales)`` after ``h`` was sent as ``sent``."""
        lost = h - rounded_apart(sent, never)
        if self.average != 0.0:  # each product rounded before the sum
            lost = rounded_apart(self.average * e, never) + rounded_apart((1.0 - self.average) * lost, never)
        return quant.store(lost, self.bits, block_size=self.block_size)


def _same(rows, salt=0):
    return rows


class Exact(NamedTuple):
    """The exact fp32 mean: no payload format, no error kept. ``block_size``: the unit its callers still cut
    buckets and slices in (the layouts of a quantized exchange of those blocks)."""

    block_size: int = quant.DEFAULT_BLOCK_SIZE
    rotate_in = rotate_out = staticmethod(_same)  # no rotation
    seed = 0  # nothing random, nothing kept: the fields LoCo's step reads of a Dense, at their off values
    compensate_second_stage = stochastic_rounding = False
    error_bits = None

    @property
    def bits(self):
        return None

    @property
    def feedback(self):
        return None

    def checked(self, beta_name="beta", *, format="int", error_bits=8, beta=0.0):
        """This value, its block size checked (it still lays out the buckets and slices), and the settings a
        builder was given beside it (unused by an exact mean, refused all the same when out of range)."""
        quant.validate_compression(None, self.block_size, format, error_bits=error_bits, beta=beta,
                                   beta_name=beta_name)
        return self


class Dense(NamedTuple):
    """Every value at ``bits`` bits (:mod:`loco_jax.quant`): ``format`` (``"int"`` absmax, ``"e3m0"``,
    ``"uniform"``, ``"lloyd"``), one scale per ``block_size`` values, in the randomized-Hadamard domain of
    ``seed`` when ``rotate``. With ``compensate`` the error is kept at ``error_bits`` as a moving average of
    weight ``beta`` (:class:`ErrorFeedback`; ``beta = 0``: plain error feedback). LoCo's two-stage all-reduce
    only: ``compensate_second_stage`` keeps a second error for the re-quantization of each device's reduced
    chunk, and ``stochastic_rounding`` rounds the payload at random, unbiased (a key from ``seed`` in the
    transformation's state, advanced every step); :func:`loco_jax.diloco.diloco` refuses both.

    The defaults are LoCo's reference settings (the authors' code: int absmax, no rotation, beta 0.8).
    ``loco.compress(bits=b)`` and ``diloco.diloco(bits=b)`` fill the settings left at None from their own
    per-bit tables instead (``loco.MEASURED``, ``diloco.MEASURED``), and build this value from them."""

    bits: int = 4
    format: quant.Format = "int"
    rotate: bool = False
    block_size: int = quant.DEFAULT_BLOCK_SIZE
    compensate: bool = True
    beta: float = 0.8
    error_bits: int | None = 8
    seed: int = 0
    compensate_second_stage: bool = False
    stochastic_rounding: bool = False

    @property
    def quant(self) -> coll.QuantConfig:
        """The payload's codec (encode, decode, the rotation)."""
        return coll.QuantConfig(self.bits, self.block_size, self.format, self.rotate, self.seed)

    @property
    def feedback(self) -> ErrorFeedback | None:
        return ErrorFeedback(None, self.beta, self.error_bits, self.block_size) if self.compensate else None

    def checked(self, beta_name="beta"):
        """This value, every setting checked (:func:`loco_jax.quant.validate_compression`), each refusal naming
        one (``beta_name``: what the caller calls ``beta``)."""
        quant.validate_compression(self.bits, self.block_size, self.format, error_bits=self.error_bits, beta=self.beta,
                                   beta_name=beta_name, rotate=self.rotate, stochastic=self.stochastic_rounding)
        return self

    def rotate_in(self, rows, salt=0):
        """Into bucket or fragment ``salt``'s rotated domain (identity unless ``rotate``)."""
        return self.quant.rotate_in(rows, salt)

    def rotate_out(self, rows, salt=0):
        return self.quant.rotate_out(rows, salt)


class Sparse(NamedTuple):
    """Each chunk's largest entries: ``code`` (a :class:`loco_jax.sparse.SparseConfig`: ``k`` of every
    ``chunk`` values, at ``bits`` in its ``format``, positions at ``index_bits``), built and checked by
    :meth:`of`. The error is the decayed accumulator ``e <- decay e + x``, less what was sent
    (:class:`ErrorFeedback` with ``carry = decay``, ``average = 0``), kept at ``error_bits`` (None: fp32)
    with one scale per ``block_size``. ``average_over``: each entry's mean over the ``"senders"`` (the
    replicas whose payload holds it) or over all ``"replicas"``; ``chunks``: ``"flat"`` (every ``chunk``
    values of the flattened fragment) or ``"leaves"`` (tiles and pieces that follow its leaves);
    ``keep_unsent``: the replicas keep their own unsent progress (:func:`loco_jax.diloco.diloco`'s module
    docstring)."""

    code: sparse_lib.SparseConfig
    decay: float = 1.0
    error_bits: int | None = None
    block_size: int = quant.DEFAULT_BLOCK_SIZE
    average_over: str = "senders"
    chunks: str = "flat"
    keep_unsent: bool = False
    rotate_in = rotate_out = staticmethod(_same)  # entries are picked in the values' own domain

    @classmethod
    def of(cls, density, *, bits=2, format=None, chunk=sparse_lib.DEFAULT_CHUNK, index_bits=None, decay=1.0,
           error_bits=None, block_size=quant.DEFAULT_BLOCK_SIZE, average_over="senders", chunks="flat",
           keep_unsent=False):
        """The sparse exchange of ``density``, every setting checked, each refusal naming it.

        Args:
          density: the share of each chunk's entries sent, in (0, 1): ``k = round(density chunk)``.
          bits, format: the kept values' width (1, 2, 4 or 8) and format (None: :data:`SPARSE_FORMATS`).
          chunk, index_bits: entries per chunk (a power of two) and the position width (None: log2(chunk));
            :func:`loco_jax.sparse.sparse_config`.
          decay: the accumulator's ``beta`` in (0, 1]: ``e <- beta e + Delta`` (1: plain error feedback;
            SparseLoCo uses 0.95).
          error_bits, block_size: the accumulator's storage (None: fp32; an entry may wait ~1/density rounds
            in it, and requantizing it every round adds up) and its scales' block.
          average_over: ``"senders"`` (each entry's sum / the replicas that sent it, as SparseLoCo's
            reference code aggregates) or ``"replicas"`` (/ M: unsent entries count as zeros).
          chunks: ``"flat"`` or ``"leaves"`` (SparseLoCo's: each matrix cut into tiles of ``sqrt(chunk)`` per
            side at most, each vector into pieces of at most ``sqrt(chunk)``, ``k`` scaled to each piece;
            :func:`loco_jax.sparse.tile_layout`).
          keep_unsent: each replica restarts from ``theta~ - beta e + theta(t + tau) - theta(t)`` and its next
            outer gradient is its whole displacement; needs ``alpha=0`` and ``overlap <= 1`` in ``diloco``.
        """
        format = SPARSE_FORMATS.get(bits, "int") if format is None else format
        for name, value, choices in (("average_over", average_over, AVERAGE_OVER), ("chunks", chunks, CHUNKS)):
            if value not in choices:
                raise ValueError(f"{name}={value!r} must be one of {choices}.")
        if chunks == "leaves" and is_int(chunk) and math.isqrt(chunk) ** 2 != chunk:
            raise ValueError(f"chunks='leaves' cuts tiles of sqrt(chunk) per side; chunk={chunk} is not a square "
                             f"(e.g. 4096 = 64 x 64, or 1024).")
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0.0 < decay <= 1.0:
            raise ValueError(f"decay={decay!r} must lie in (0, 1] (1: plain error feedback; SparseLoCo uses 0.95).")
        if not isinstance(keep_unsent, bool):
            raise ValueError(f"keep_unsent={keep_unsent!r} must be True or False.")
        code = sparse_lib.sparse_config(density, chunk=chunk, bits=bits, format=format, index_bits=index_bits)
        error_format = "int" if format in sparse_lib.SPARSE_FORMAT_BITS else format  # the error blocks' own
        quant.validate_compression(bits, block_size, error_format, error_bits=error_bits, beta=0.0)
        return cls(code, float(decay), error_bits, block_size, average_over, chunks, keep_unsent)

    @property
    def bits(self) -> int:
        return self.code.bits

    @property
    def feedback(self) -> ErrorFeedback:
        return ErrorFeedback(self.decay, 0.0, self.error_bits, self.block_size)


CODECS = (Exact, Dense, Sparse)


def require_defaults(factory, codec, **given):
    """With an exchange value passed to ``factory`` (``loco.compress``, ``diloco.diloco``), the arguments that
    describe a codec stay at ``factory``'s defaults: the value carries them. Each one given is refused by name."""
    defaults = inspect.signature(factory).parameters
    for name, value in given.items():
        default = defaults[name].default
        if value != default:
            raise ValueError(f"{factory.__module__.split('.')[-1]}.{factory.__name__}({codec!r}, {name}={value!r}): "
                             f"the exchange value describes the codec, so {name} stays at its default "
                             f"({default!r}); build the value with the setting you want, or pass bits as an int "
                             f"with {name}={value!r}.")
