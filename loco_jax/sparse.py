"""Sparse low-bit payloads: the ``k`` largest entries of every chunk, their values at a few bits, their
positions packed (the SparseLoCo class of outer-gradient exchanges; docs/algorithms.md, "6. DiLoCo and
Streaming DiLoCo", the sparse exchange).

A flat fp32 vector of ``n = N C`` values is cut into ``N`` chunks of ``C`` values (a power of two). In each
chunk ``c``::

    I_c  = the k positions of largest |x_c[i]|               (ties: the lower position first)
    s_c, q_c = Q_b(x_c[I_c])                                  (one block of k values, one fp32 scale)
    payload_c = pack_w(I_c) | pack_b(q_c) | s_c               (w = index_bits >= log2 C)
    decode:  y_c[i] = DQ_b(q_c, s_c)[j]  where i = I_c[j],  0 elsewhere

so every chunk's payload has the same static size, ``k (w + b) / 8`` bytes rounded up to whole bytes for
each part, plus 4 bytes of scale, and a vector's payload is an ``(N, bytes)`` ``uint8`` array that one
``all_gather`` moves. Bits per value of the dense vector: ``(k (w + b) + 32) / C`` (``C = 4096, k = 64,
w = 12, b = 2``: 0.227). A chunk holding NaN or Inf gets a NaN scale, so its decoded values are NaN and a
mean over replicas shows it (the exchange then drops the round, as the dense exchange does).

Values use the project's quantizers (:func:`loco_jax.quant.quantize`; any format of
:data:`loco_jax.quant.FORMATS` at its bit widths, one fp32 scale per chunk) or ``"binmean"``, SparseLoCo's
2-bit quantizer (:func:`binmean_quantize`: the kept values centred on their mean, 4 bins 1.5 standard
deviations wide, each decoded to its bin's mean; 20 bytes of statistics in place of the scale, per chunk,
or per leaf of a :class:`TiledSparse` slice as SparseLoCo takes them per tensor);
positions are a fixed-width code, little-endian in a bit stream (:func:`pack_bits`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from loco_jax import quant
from loco_jax.checks import is_int, require_int

DEFAULT_CHUNK = 4096


def pack_bits(values, width: int):
    """Unsigned ``width``-bit integers along the last axis as one little-endian bit stream in ``uint8``
    (value ``i``'s bit ``j`` is stream bit ``i width + j``), zero-padded to whole bytes:
    ``ceil(n width / 8)`` bytes per row. Inverse: :func:`unpack_bits`."""
    n = values.shape[-1]
    v = values.astype(jnp.uint32)[..., None]
    bits = ((v >> jnp.arange(width, dtype=jnp.uint32)) & 1).astype(jnp.uint8)
    bits = bits.reshape(*values.shape[:-1], n * width)
    bits = jnp.pad(bits, [(0, 0)] * (bits.ndim - 1) + [(0, -(n * width) % 8)])
    grouped = bits.reshape(*bits.shape[:-1], -1, 8)
    return jnp.sum(grouped << jnp.arange(8, dtype=jnp.uint8), axis=-1, dtype=jnp.uint8)


def unpack_bits(packed, width: int, n: int):
    """The ``n`` ``width``-bit values (``uint32``) of each row of :func:`pack_bits`' output."""
    bits = (packed[..., None] >> jnp.arange(8, dtype=jnp.uint8)) & 1
    bits = bits.reshape(*packed.shape[:-1], -1)[..., : n * width].reshape(*packed.shape[:-1], n, width)
    return jnp.sum(bits.astype(jnp.uint32) << jnp.arange(width, dtype=jnp.uint32), axis=-1, dtype=jnp.uint32)


# Values formats of the sparse payload alone (not loco_jax.quant's: they need the whole set of kept values),
# with the bit widths each takes.
SPARSE_FORMAT_BITS = {"binmean": (2,)}
BINMEAN_BINS = 4
BINMEAN_WIDTH = 1.5  # a bin's width in standard deviations of the centred values (6 sigma over 4 bins)


def binmean_quantize(values, segments=None, num_segments=None):
    """SparseLoCo's 2-bit values quantizer, over the last axis of ``values`` (one row: one chunk's kept values)::

        mu = mean(v),  c = v - mu,  sigma = std(c) (unbiased; 0 for one value),  w = 1.5 sigma
        q = clip(round(c / w + 2), 0, 3)                       (w = 1 where sigma = 0: every q is 2)
        L[b] = mean of c over the values with q = b          (0 for an empty bin)
        decode:  v^ = L[q] + mu

    with one set of statistics ``(mu, sigma, L)`` per row, or, given ``segments`` (one int per row of a 2-D
    ``values``, in ``[0, num_segments)``), per segment: pooled over every value of the rows that share an id
    (SparseLoCo's statistics per tensor, when a row's id is its leaf).

    Returns ``(codes uint8 (..., k), side fp32)``, ``side = (mu, L[0], ..., L[3])`` per row ``(..., 5)`` or
    per segment ``(num_segments, 5)`` (an empty segment: zeros). A row holding NaN or Inf gets a NaN side
    (its segment's, when pooled), so it decodes to NaN (the sparse mean then shows it). Inverse:
    :func:`binmean_dequantize`. Every bin decodes to the mean of what it holds, so a row's (segment's)
    decoded sum equals its sum (up to rounding): the quantizer moves no mass, it only spreads it within
    each bin.
    """
    v = jnp.asarray(values, jnp.float32)
    k = v.shape[-1]
    if segments is None:  # each row its own statistics
        pool = spread = lambda x: x
    else:
        if v.ndim != 2 or segments.shape != v.shape[:1]:
            raise ValueError(f"segments of shape {segments.shape} must hold one id per row of the 2-D values "
                             f"{v.shape}.")
        pool = lambda x: jax.ops.segment_sum(x, segments, num_segments)  # noqa: E731
        spread = lambda x: x[segments]  # noqa: E731
    finite = jnp.all(jnp.isfinite(v), axis=-1, keepdims=True)
    v = jnp.where(finite, v, 0.0)
    count = pool(jnp.full(v.shape[:-1] + (1,), float(k)))
    mu = pool(jnp.sum(v, axis=-1, keepdims=True)) / jnp.maximum(count, 1.0)
    c = v - spread(mu)
    sigma = jnp.sqrt(pool(jnp.sum(c * c, axis=-1, keepdims=True)) / jnp.maximum(count - 1.0, 1.0))
    width = jnp.where(sigma > 0, BINMEAN_WIDTH * sigma, 1.0)
    q = jnp.clip(jnp.round(c / spread(width) + BINMEAN_BINS // 2), 0, BINMEAN_BINS - 1).astype(jnp.uint8)
    member = q[..., None] == jnp.arange(BINMEAN_BINS, dtype=jnp.uint8)  # (..., k, bins)
    total = pool(jnp.sum(jnp.where(member, c[..., None], 0.0), axis=-2))
    held = pool(jnp.sum(member, axis=-2).astype(jnp.float32))
    table = jnp.where(held > 0, total / jnp.maximum(held, 1.0), 0.0)
    side = jnp.concatenate([mu, table], axis=-1)
    return q, jnp.where(pool(jnp.where(finite, 0.0, 1.0)) > 0, jnp.nan, side)


def binmean_dequantize(codes, side, segments=None):
    """The values of :func:`binmean_quantize`'s ``(codes, side)``: ``L[q] + mu`` per row, with ``segments``
    (the rows' ids, over the second-to-last axis of ``codes``) each row through its segment's side."""
    if segments is not None:
        side = jnp.take(side, segments, axis=-2)
    table = side[..., 1:]
    return jnp.take_along_axis(table, codes.astype(jnp.int32), axis=-1) + side[..., :1]


def largest_divisor(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is at most ``limit`` (1 for a prime ``n`` above it)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


class TileLayout(NamedTuple):
    """Chunks that follow the leaves (:func:`tile_layout`): a fragment's flat values reordered so that each
    chunk is one 2-D tile of one matrix or one piece of one 1-D leaf, laid out per data device.

    The tiled vector is ``devices`` slices of ``slice_len`` values, every slice laid out alike: for each
    class ``(C, n)`` of ``classes``, ``n`` chunks of ``C`` values, then ``slice_len - sum C n`` padding.
    ``leaf[d][c]``: per device ``d`` and class ``c``, each chunk's leaf (piece) index, -1 for a padding chunk
    (for statistics per tensor). :meth:`tiled` and :meth:`untiled` reorder with reshapes, transposes and
    pads; :meth:`permutation` is the same order as an index table (for tests: it is the fragment's size)."""

    classes: tuple
    slice_len: int
    leaf: tuple
    shapes: tuple  # the leaves' shapes (extract order)
    tile: int
    devices: int

    def permutation(self) -> np.ndarray:
        """``perm[t]``: the flat (extract-order) index of position ``t`` of the tiled vector, -1 for padding."""
        n = sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)
        if n >= 2**31 - 1:
            raise ValueError(f"permutation() of a fragment of {n} values: int32 positions hold fewer than 2**31.")
        return np.asarray(self.tiled(jnp.arange(1, n + 1, dtype=jnp.int32))).astype(np.int64) - 1

    def tiled(self, flat):
        """``flat`` (the fragment in extract order) in this layout's order, zeros at the padding: per-leaf
        reshapes and transposes, concatenations and pads (no index table: ``perm`` is its reference)."""
        devices = self.devices
        by_size, at = {}, 0
        for shape in self.shapes:
            n = int(np.prod(shape, dtype=np.int64))
            if n:
                size, chunks = _tile(flat[at:at + n], tuple(shape), self.tile)
                by_size.setdefault(size, []).append(chunks)
            at += n
        runs = []
        for size, per in self.classes:
            chunks = jnp.concatenate(by_size[size])
            chunks = jnp.pad(chunks, ((0, per * devices - chunks.shape[0]), (0, 0)))
            runs.append(chunks.reshape(devices, per * size))
        used = sum(c * n for c, n in self.classes)
        runs.append(jnp.zeros((devices, self.slice_len - used), flat.dtype))
        return jnp.concatenate(runs, axis=1).reshape(-1)

    def untiled(self, tiled):
        """Inverse of :meth:`tiled`: the fragment in extract order."""
        devices = self.devices
        rows = tiled.reshape(devices, self.slice_len)
        by_size, at = {}, 0
        for size, per in self.classes:
            by_size[size] = rows[:, at:at + per * size].reshape(devices * per, size)
            at += per * size
        taken = {size: 0 for size in by_size}
        parts = []
        for shape in self.shapes:
            n = int(np.prod(shape, dtype=np.int64))
            if not n:
                continue
            size, count = _tile_counts(tuple(shape), self.tile)
            chunks = by_size[size][taken[size]:taken[size] + count]
            taken[size] += count
            parts.append(_untile(chunks, tuple(shape), self.tile))
        return jnp.concatenate(parts)


def _tile_dims(shape, tile):
    """``(batch, rows, th, cols, tw)``: a matrix leaf (its last two axes) as ``batch`` matrices of
    ``rows x cols`` cut into ``th x tw`` tiles; a vector (or scalar) as one row cut into pieces of ``tw``."""
    n = int(np.prod(shape, dtype=np.int64))
    if len(shape) >= 2:
        rows, cols = int(shape[-2]), int(shape[-1])
        return n // (rows * cols), rows, largest_divisor(rows, tile), cols, largest_divisor(cols, tile)
    return 1, 1, 1, n, largest_divisor(n, tile)


def _tile_counts(shape, tile):
    """``(chunk size, chunks)`` of one leaf."""
    batch, rows, th, cols, tw = _tile_dims(shape, tile)
    return th * tw, batch * (rows // th) * (cols // tw)


def _tile(x, shape, tile):
    """``(C, (chunks, C))``: one leaf's flat values cut into its tiles (or pieces), in chunk order."""
    batch, rows, th, cols, tw = _tile_dims(shape, tile)
    t = x.reshape(batch, rows // th, th, cols // tw, tw).transpose(0, 1, 3, 2, 4)
    return th * tw, t.reshape(-1, th * tw)


def _untile(chunks, shape, tile):
    """Inverse of :func:`_tile`: the leaf's flat values."""
    batch, rows, th, cols, tw = _tile_dims(shape, tile)
    return chunks.reshape(batch, rows // th, cols // tw, th, tw).transpose(0, 1, 3, 2, 4).reshape(-1)


def tile_layout(shapes, devices: int = 1, *, tile: int = 64, align: int = 1) -> TileLayout:
    """The :class:`TileLayout` of a fragment whose leaves (pieces, in extract order) have ``shapes``, for
    ``devices`` data devices that each send one slice of it.

    Each matrix (a leaf of 2 or more axes: the last two, per leading index) is cut into tiles of
    ``a x b`` values, ``a`` and ``b`` the largest divisors of its sides that are at most ``tile``; each 1-D
    leaf into pieces of the largest divisor of its length at most ``tile``. Chunks of one size form a
    class (largest first, in leaf order within it); each class's chunks are dealt to the devices in
    contiguous runs, padded with zero chunks to a multiple of ``devices``; each slice is padded to a
    multiple of ``align`` (an error buffer's block). No chunk crosses a leaf, and the layout is static.
    """
    require_int("devices", devices, minimum=1)
    require_int("tile", tile, minimum=1)
    require_int("align", align, minimum=1)
    shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
    owners: dict[int, list] = {}
    for leaf, shape in enumerate(shapes):
        if int(np.prod(shape, dtype=np.int64)):
            size, count = _tile_counts(shape, tile)
            owners.setdefault(size, []).append(np.full(count, leaf))
    classes, leaves = [], []
    for size in sorted(owners, reverse=True):
        owner = np.concatenate(owners[size])
        per = -(-len(owner) // devices)
        owner = np.concatenate([owner, np.full(per * devices - len(owner), -1)]).reshape(devices, per)
        classes.append((size, per))
        leaves.append(owner)
    used = sum(c * n for c, n in classes)
    slice_len = max(-(-used // align) * align, align)
    leaf = tuple(tuple(owner[d] for owner in leaves) for d in range(devices))
    return TileLayout(tuple(classes), slice_len, leaf, shapes, tile, devices)


class SparseConfig(NamedTuple):
    """A top-``k``-per-chunk payload: ``chunk`` values per chunk, ``k`` kept, values at ``bits`` in
    ``format``, positions at ``index_bits``. Build it with :func:`sparse_config` (which checks it)."""

    chunk: int
    k: int
    bits: int
    format: str
    index_bits: int

    def chunk_bytes(self, pooled: bool = False) -> tuple[int, int, int]:
        """Bytes of one chunk's positions, values and statistics (:meth:`side_bytes`; 0 when ``pooled``: the
        statistics then travel once per segment)."""
        return -(-self.k * self.index_bits // 8), -(-self.k * self.bits // 8), 0 if pooled else self.side_bytes()

    def side_bytes(self) -> int:
        """Bytes of one set of statistics: a scale, or ``binmean``'s mean and 4 bin means."""
        return 4 * (1 + BINMEAN_BINS) if self.format == "binmean" else 4

    def payload_bytes(self, n: int) -> int:
        """Bytes of the payload of ``n`` values (a whole number of chunks)."""
        return (n // self.chunk) * sum(self.chunk_bytes())

    def bits_per_value(self) -> float:
        """Wire bits per value of the dense vector."""
        return 8 * sum(self.chunk_bytes()) / self.chunk

    def select(self, x):
        """``(positions (N, k) int32, values (N, k) fp32, finite (N,))`` of a flat ``x`` of ``N C`` values:
        each chunk's ``k`` entries of largest magnitude."""
        chunks = x.reshape(-1, self.chunk)
        finite = jnp.all(jnp.isfinite(chunks), axis=-1)
        _, positions = lax.top_k(jnp.abs(jnp.where(finite[:, None], chunks, 0.0)), self.k)
        return positions, jnp.take_along_axis(chunks, positions, axis=-1), finite

    def encode(self, x, segments=None, num_segments=None):
        """``(payload uint8, sent (N C,) fp32)`` of a flat fp32 ``x``: ``sent`` is what the payload decodes
        to (for error feedback), computed without unpacking it. The payload is ``(N, bytes)``, one row per
        chunk; with ``segments`` (``binmean`` only: one id per chunk, statistics pooled per id, see
        :func:`binmean_quantize`) it is flat: the ``N`` chunks' positions and codes, then ``num_segments``
        sets of statistics."""
        positions, values, finite = self.select(x)
        values = jnp.where(finite[:, None], values, jnp.nan)
        if self.format == "binmean":
            codes, side = binmean_quantize(values, segments, num_segments)
            decoded = binmean_dequantize(codes, side, segments)
        elif segments is not None:
            raise ValueError(f"segments pool binmean's statistics; format={self.format!r} has one scale per chunk.")
        else:
            codes, side = quant.quantize(jnp.where(finite[:, None], values, 0.0), self.bits, format=self.format)
            side = jnp.where(finite, side, jnp.nan)
            decoded = quant.dequantize(codes, side, self.bits, format=self.format)
            side = side[:, None]
        rows = jnp.concatenate([pack_bits(positions, self.index_bits), pack_bits(codes, self.bits)], axis=-1)
        side = lax.bitcast_convert_type(side, jnp.uint8).reshape(side.shape[0], -1)
        payload = (jnp.concatenate([rows, side], axis=-1) if segments is None
                   else jnp.concatenate([rows.reshape(-1), side.reshape(-1)]))
        return payload, self._scatter(positions, decoded).reshape(-1)

    def decode(self, payload, *, held=False, segments=None, num_segments=None):
        """The dense fp32 values ``(..., N C)`` of payloads ``(..., N, bytes)`` (with ``segments``:
        ``(..., payload bytes)``, as :meth:`encode` wrote them); ``held``: also the dense fp32 indicator of
        the positions each payload holds (1 at its ``k`` positions per chunk, 0 elsewhere), taken from the
        positions, not the values (a kept entry may decode to 0, and ``uniform`` has no zero level):
        ``(values, held)``."""
        pos_bytes, val_bytes, _ = self.chunk_bytes()
        if segments is None:
            rows, side = payload[..., :pos_bytes + val_bytes], payload[..., pos_bytes + val_bytes:]
        else:
            cut = payload.shape[-1] - num_segments * self.side_bytes()
            rows = payload[..., :cut].reshape(*payload.shape[:-1], -1, pos_bytes + val_bytes)
            side = payload[..., cut:].reshape(*payload.shape[:-1], num_segments, -1)
        positions = unpack_bits(rows[..., :pos_bytes], self.index_bits, self.k).astype(jnp.int32)
        codes = unpack_bits(rows[..., pos_bytes:], self.bits, self.k).astype(jnp.uint8)
        if self.format == "binmean":
            side = lax.bitcast_convert_type(side.reshape(*side.shape[:-1], -1, 4), jnp.float32)
            values = binmean_dequantize(codes, side, segments)
        else:
            values = quant.dequantize(codes, lax.bitcast_convert_type(side, jnp.float32), self.bits,
                                      format=self.format)
        lead = rows.shape[:-1]
        flat_positions = positions.reshape(-1, self.k)
        dense = self._scatter(flat_positions, values.reshape(-1, self.k)).reshape(*lead[:-1], lead[-1] * self.chunk)
        if not held:
            return dense
        ones = jnp.ones(flat_positions.shape, jnp.float32)
        return dense, self._scatter(flat_positions, ones).reshape(dense.shape)

    def _scatter(self, positions, values):
        """``(rows, C)`` zeros with ``values`` written at ``positions`` (distinct within a row)."""
        rows = jnp.arange(positions.shape[0])[:, None]
        return jnp.zeros((positions.shape[0], self.chunk), jnp.float32).at[rows, positions].set(
            values, unique_indices=True)


class TiledSparse(NamedTuple):
    """A top-k payload over a :class:`TileLayout`'s slice: one :class:`SparseConfig` per chunk class (its
    ``k = max(1, round(density C))``, positions in ``ceil(log2 C)`` bits), the classes' payloads flattened
    and concatenated into one static ``uint8`` vector; the slice's padding tail is not sent. Build it with
    :func:`tiled_sparse`.

    ``binmean`` takes its statistics per leaf, as SparseLoCo's code takes them per tensor: over the kept
    values of every chunk of one leaf in one device's slice (its padding chunks apart), one set per leaf
    in the slice instead of one per chunk. Which leaves a slice holds depends on the device, so
    :meth:`encode` and :meth:`decode` take the data device's index (traced under ``shard_map``)."""

    classes: tuple  # ((C, n), ...): n chunks of C values per class, in slice order
    configs: tuple  # one SparseConfig per class
    slice_len: int
    segments: tuple = ()  # binmean: per class, per device, each chunk's segment id (its leaf's, relabelled)
    num_segments: tuple = ()  # binmean: per class, the segments per slice

    def payload_bytes(self) -> int:
        return sum(self._class_bytes(c) for c in range(len(self.classes)))

    def _class_bytes(self, c) -> int:
        """Bytes of class ``c``'s payload: its chunks' positions and codes, and its statistics (per chunk, or
        per segment when pooled)."""
        (_, n), cfg = self.classes[c], self.configs[c]
        pos, val, side = cfg.chunk_bytes(pooled=bool(self.segments))
        return n * (pos + val + side) + (self.num_segments[c] * cfg.side_bytes() if self.segments else 0)

    def _segments(self, c, device):
        """Class ``c``'s segment ids on data device ``device`` (an int or a traced index), and their count."""
        if not self.segments:
            return None, None
        table = np.asarray(self.segments[c], np.int32)
        if isinstance(device, int) or len(table) == 1:  # a static row (one device: the traced index is 0)
            return jnp.asarray(table[device if isinstance(device, int) else 0]), self.num_segments[c]
        return jnp.asarray(table)[device], self.num_segments[c]

    def encode(self, x, device=0):
        """``(payload (bytes,) uint8, sent (slice_len,) fp32)`` of data device ``device``'s slice ``x``."""
        payloads, sent, at = [], [], 0
        for c, ((size, n), cfg) in enumerate(zip(self.classes, self.configs)):
            payload, part = cfg.encode(x[at:at + size * n], *self._segments(c, device))
            payloads.append(payload.reshape(-1))
            sent.append(part)
            at += size * n
        sent.append(jnp.zeros((self.slice_len - at,), jnp.float32))
        return jnp.concatenate(payloads), jnp.concatenate(sent)

    def decode(self, payload, device=0, *, held=False):
        """The dense slices ``(..., slice_len)`` of data device ``device``'s payloads ``(..., bytes)``
        (``held``: also the indicator of the positions each holds, as :meth:`SparseConfig.decode`)."""
        lead = payload.shape[:-1]
        values, marks, at = [], [], 0
        for c, ((size, n), cfg) in enumerate(zip(self.classes, self.configs)):
            segments, count = self._segments(c, device)
            width = self._class_bytes(c)
            part = payload[..., at:at + width]
            if segments is None:
                part = part.reshape(*lead, n, -1)
            out = cfg.decode(part, held=held, segments=segments, num_segments=count)
            at += width
            values.append(out[0] if held else out)
            if held:
                marks.append(out[1])
        used = sum(size * n for size, n in self.classes)
        tail = jnp.zeros(lead + (self.slice_len - used,), jnp.float32)
        dense = jnp.concatenate(values + [tail], axis=-1)
        return (dense, jnp.concatenate(marks + [tail], axis=-1)) if held else dense


def leaf_segments(layout: TileLayout):
    """``(segments, num_segments)`` of ``layout`` for statistics per leaf: per class, per device, each
    chunk's segment id (the slice's leaves in order 0, 1, ...; its padding chunks one more), and per class
    the largest count of segments on any device."""
    segments, counts = [], []
    for c in range(len(layout.classes)):
        per_device = []
        for d in range(layout.devices):
            owner = np.asarray(layout.leaf[d][c])
            leaves = np.unique(owner[owner >= 0])
            ids = np.where(owner >= 0, np.searchsorted(leaves, owner), len(leaves))
            per_device.append(tuple(int(i) for i in ids))
        segments.append(tuple(per_device))
        counts.append(max(max(ids, default=-1) + 1 for ids in per_device))
    return tuple(segments), tuple(counts)


def tiled_sparse(layout: TileLayout, density: float, *, bits: int = 2, format: str = "uniform") -> TiledSparse:
    """The :class:`TiledSparse` payload of ``layout`` at ``density`` (in (0, 1)), values at ``bits`` in
    ``format`` (checked as :func:`sparse_config` checks them; ``binmean`` takes its statistics per leaf,
    :func:`leaf_segments`, so any ``k`` serves: a leaf of one kept value decodes it exactly)."""
    _check_density(density)
    configs = []
    for size, _ in layout.classes:
        k = min(max(1, round(density * size)), size)
        _check_values(bits, format, k, size, pooled=True)
        configs.append(SparseConfig(size, k, bits, format, max(1, math.ceil(math.log2(size)))))
    pooled = leaf_segments(layout) if format == "binmean" else ((), ())
    return TiledSparse(layout.classes, tuple(configs), layout.slice_len, *pooled)


def _check_density(density):
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0.0 < density < 1.0:
        raise ValueError(f"density={density!r} must lie in (0, 1): the fraction of each chunk's entries sent.")


def _check_values(bits, format, k, chunk, pooled=False):
    """The kept values' format at ``bits``: one of :mod:`loco_jax.quant`'s, or a sparse-only one (which also
    needs ``k >= 2`` of each ``chunk`` values for statistics of their own; pooled over a leaf, any ``k``)."""
    if format not in SPARSE_FORMAT_BITS:
        quant.validate_format(bits, format)
        return
    if bits not in SPARSE_FORMAT_BITS[format]:
        raise ValueError(f"format={format!r} takes bits in {SPARSE_FORMAT_BITS[format]} (its {BINMEAN_BINS} "
                         f"bins), not bits={bits!r}.")
    if k < 2 and not pooled:
        raise ValueError(f"format={format!r} keeps k = {k} entry per chunk; its statistics need k >= 2: use a "
                         f"density >= {2 / chunk:.3g} for chunk={chunk}.")


def sparse_config(density: float, *, chunk: int = DEFAULT_CHUNK, bits: int = 2, format: quant.Format = "int",
                  index_bits: int | None = None) -> SparseConfig:
    """A checked :class:`SparseConfig`: ``k = round(density C)`` entries of every ``C = chunk`` values.

    ``density`` in (0, 1); ``chunk`` a power of two >= 2; ``k`` in [1, C); ``bits`` one of ``format``'s
    widths (:data:`loco_jax.quant.FORMAT_BITS`, or :data:`SPARSE_FORMAT_BITS` for ``"binmean"``, which also
    needs ``k >= 2`` for its standard deviation); ``index_bits`` (None: ``log2 C``) wide enough for a
    position in the chunk, at most 32.
    """
    _check_density(density)
    require_int("chunk", chunk, "a power of two >= 2", minimum=2)
    if chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two (e.g. {1 << (chunk.bit_length() - 1)} or "
                         f"{1 << chunk.bit_length()}), so that a position fits log2(chunk) bits.")
    k = round(density * chunk)
    if not 1 <= k < chunk:
        raise ValueError(f"density={density} keeps k = round({density} x {chunk}) = {k} entries of a "
                         f"{chunk}-entry chunk; k must lie in [1, {chunk - 1}]: use a density in "
                         f"[{1 / chunk:.3g}, {(chunk - 1) / chunk:.6g}] or another chunk.")
    _check_values(bits, format, k, chunk)
    need = int(math.log2(chunk))
    index_bits = need if index_bits is None else index_bits
    if not is_int(index_bits) or not need <= index_bits <= 32:
        raise ValueError(f"index_bits={index_bits!r} cannot hold a position in a {chunk}-entry chunk: it must "
                         f"be an int in [{need}, 32] (log2({chunk}) = {need}).")
    return SparseConfig(chunk, k, bits, format, index_bits)


__all__ = ["DEFAULT_CHUNK", "SPARSE_FORMAT_BITS", "SparseConfig", "TileLayout", "TiledSparse", "largest_divisor",
           "leaf_segments", "tile_layout", "tiled_sparse", "binmean_dequantize", "binmean_quantize",
           "pack_bits", "sparse_config", "unpack_bits"]
