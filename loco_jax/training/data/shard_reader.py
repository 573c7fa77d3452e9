"""Reading token shards: a lazy concatenation of memory-mapped shard files, and the checks made when a
directory is opened (:mod:`loco_jax.training.data.shard_format` describes the directory).


Streams
=======
The train stream is the ``"train"`` shards concatenated in manifest order; the eval stream is the
shards ``eval.shards`` names, or, with ``eval.tail_tokens = k``, the last ``k`` tokens of the train
shards (which the train stream then leaves out). Shards are memory-mapped on first use (at most
:data:`OPEN_SHARDS` at a time) and never read whole: :class:`ShardedTokens` is a 1-D, read-only view of
the concatenation that :class:`~loco_jax.training.data.batches.Batcher` and ``eval_windows`` index by global
position, so batches by global sample index, their determinism and the one-integer data position of
a checkpoint are exactly those of a single token file holding the same stream (a test holds it to that).

Loading checks, before anything compiles, that the manifest is well formed, that every shard exists
with exactly ``tokens x itemsize`` bytes, and that the tokenizer matches the config's (kind, vocabulary
and, when ``data.sp_model`` is set, the SHA-256 of the model file); each error names the file and the
fix. :func:`verify_shards` also re-reads every byte against the recorded SHA-256 (slow; not done at start).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import mmap
import os
import threading
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from loco_jax.training.data.corpus import file_sha256
from loco_jax.training.data.shard_format import MANIFEST, OPEN_SHARDS, SPLITS, DTYPES, remake_hint, read_manifest
from loco_jax.training.data.tokenizers import ByteTokenizer, SentencePieceTokenizer


WILLNEED = getattr(mmap, "MADV_WILLNEED", None)  # Linux, macOS; elsewhere reads are not announced


class _MapCache:
    """Read-only memory maps of a list of files, opened on first use; past ``capacity`` the least recently used
    is dropped (each map holds a file descriptor)."""

    def __init__(self, files: Sequence[Path], counts: Sequence[int], dtype: np.dtype, capacity: int = OPEN_SHARDS):
        self.files, self.counts, self.dtype, self.capacity = list(files), list(counts), dtype, capacity
        self._maps: collections.OrderedDict[int, tuple[mmap.mmap, np.ndarray]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _entry(self, k: int) -> tuple[mmap.mmap, np.ndarray]:
        with self._lock:
            entry = self._maps.get(k)
            if entry is None:
                with open(self.files[k], "rb") as f:
                    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                entry = (mm, np.frombuffer(mm, dtype=self.dtype, count=self.counts[k]))
                self._maps[k] = entry
                while len(self._maps) > self.capacity:
                    self._maps.popitem(last=False)  # closed once nothing refers to it (reads copy out)
            else:
                self._maps.move_to_end(k)
            return entry

    def get(self, k: int) -> np.ndarray:
        """Shard ``k`` as a read-only 1-D array over its memory map."""
        return self._entry(k)[1]

    def advise(self, k: int, lo, hi):
        """Tells the kernel that tokens ``[lo[i], hi[i])`` of shard ``k`` will be read soon (``MADV_WILLNEED``):
        it starts reading them from storage in the background, all the ranges at once."""
        if WILLNEED is None:
            return
        mm = self._entry(k)[0]
        size, page = self.dtype.itemsize, mmap.PAGESIZE
        start = np.asarray(lo, np.int64) * size // page * page
        stop = np.minimum(np.asarray(hi, np.int64) * size, len(mm))
        for a, n in zip(start.tolist(), (stop - start).tolist()):
            mm.madvise(WILLNEED, a, n)


class ShardedTokens:
    """A read-only 1-D token stream: positions ``[start, stop)`` of shard files concatenated in order.

    Behaves like the 1-D array it stands for where the data code needs it (``len``, ``dtype``, integer,
    slice and integer-array indexing, ``np.asarray``), without reading the shards: a read maps only the
    shards it touches. :meth:`windows` reads rows of consecutive tokens as slices (the batch path).
    ``fingerprint`` identifies the contents (file names, sizes, SHA-256s and the range), not the location.
    """

    ndim = 1

    def __init__(self, files: Sequence[str | os.PathLike], counts: Sequence[int], dtype, *, start: int = 0,
                 stop: int | None = None, fingerprint: str = "", _cache: _MapCache | None = None):
        self.dtype = np.dtype(dtype)
        counts = [int(c) for c in counts]
        self._bounds = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        total = int(self._bounds[-1])
        stop = total if stop is None else int(stop)
        if not 0 <= start <= stop <= total:
            raise ValueError(f"range [{start}, {stop}) is not within the {total} tokens of the shards.")
        self._start, self._stop = int(start), stop
        self._cache = _cache or _MapCache([Path(f) for f in files], counts, self.dtype)
        self.files = tuple(self._cache.files)
        self.fingerprint = fingerprint

    # ------------------------------------------------------------ array protocol

    def __len__(self) -> int:
        return self._stop - self._start

    @property
    def shape(self) -> tuple[int]:
        return (len(self),)

    @property
    def size(self) -> int:
        return len(self)

    @property
    def nbytes(self) -> int:
        return len(self) * self.dtype.itemsize

    def __repr__(self):
        return (f"ShardedTokens({len(self):,} {self.dtype.name} tokens over {len(self.files)} shard(s), "
                f"positions [{self._start}, {self._stop}))")

    def view(self, start: int, stop: int) -> "ShardedTokens":
        """Positions ``[start, stop)`` of this stream (no copy; shares the open maps)."""
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"view [{start}, {stop}) is not within the {len(self)} tokens of {self!r}.")
        return ShardedTokens(self.files, self._cache.counts, self.dtype, start=self._start + start,
                             stop=self._start + stop, fingerprint=f"{self.fingerprint}[{start}:{stop}]",
                             _cache=self._cache)

    def _read(self, lo: int, hi: int) -> np.ndarray:
        """Global positions ``[lo, hi)`` (within range) as one array."""
        if hi <= lo:
            return np.zeros((0,), self.dtype)
        k = int(np.searchsorted(self._bounds, lo, side="right")) - 1
        parts = []
        while lo < hi:
            base, end = int(self._bounds[k]), int(self._bounds[k + 1])
            take = min(hi, end)
            parts.append(self._cache.get(k)[lo - base : take - base])
            lo, k = take, k + 1
        return np.array(parts[0]) if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, key):
        n = len(self)
        if isinstance(key, slice):
            lo, hi, step = key.indices(n)
            if step == 1:
                return self._read(self._start + lo, self._start + max(lo, hi))
            return self[np.arange(lo, hi, step)]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (n if key < 0 else 0)
            if not 0 <= i < n:
                raise IndexError(f"index {int(key)} is out of bounds for {n} tokens.")
            return self._read(self._start + i, self._start + i + 1)[0]
        idx = np.asarray(key)
        if idx.dtype.kind not in "iu":
            raise TypeError(f"ShardedTokens takes integer, slice or integer-array indices, not {idx.dtype}.")
        idx = idx.astype(np.int64)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise IndexError(f"an index lies outside the {n} tokens.")
        g = np.where(idx < 0, idx + n, idx).reshape(-1) + self._start
        out = np.empty(g.shape, self.dtype)
        shard = np.searchsorted(self._bounds, g, side="right") - 1
        for k in np.unique(shard):
            sel = shard == k
            out[sel] = self._cache.get(int(k))[g[sel] - self._bounds[k]]
        return out.reshape(idx.shape)

    def __array__(self, dtype=None, copy=None):
        out = self._read(self._start, self._stop)
        return out if dtype is None else out.astype(dtype)

    def prefetch(self, starts, length: int):
        """Announces reads of ``[starts[r], starts[r] + length)`` (``MADV_WILLNEED``; returns at once): the
        kernel fetches every range from storage concurrently, instead of one page fault after another when the
        rows are copied. :class:`~loco_jax.training.data.batches.Batcher` announces the next batch's rows this way,
        so their reads overlap the current step."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int(length)
        if not starts.size or WILLNEED is None or length < 1:
            return
        lo = np.clip(starts, 0, max(0, len(self) - length)) + self._start
        hi = np.minimum(lo + length, self._stop)
        first = np.searchsorted(self._bounds, lo, side="right") - 1
        last = np.searchsorted(self._bounds, hi - 1, side="right") - 1
        inside = np.flatnonzero(first == last)  # most ranges: within one shard, grouped by shard
        order = inside[np.argsort(first[inside], kind="stable")]
        shard_of, begin = np.unique(first[order], return_index=True)
        for k, group in zip(shard_of.tolist(), np.split(order, begin[1:])):
            base = self._bounds[k]
            self._cache.advise(k, lo[group] - base, hi[group] - base)
        for r in np.flatnonzero(first != last):  # a range across shard boundaries: each shard's part
            for k in range(int(first[r]), int(last[r]) + 1):
                base, end = int(self._bounds[k]), int(self._bounds[k + 1])
                self._cache.advise(k, [max(int(lo[r]), base) - base], [min(int(hi[r]), end) - base])

    def windows(self, starts, length: int, *, announce: bool = True) -> np.ndarray:
        """``out[r] = self[starts[r] : starts[r] + length]``, ``[len(starts), length]`` of the shards' dtype.

        Each row is one slice of a memory map (two or more where it crosses a shard boundary): a copy of
        ``length`` tokens, not a per-token gather. Every row's read is announced first (:meth:`prefetch`;
        ``announce=False`` where the caller already did), so rows that are not in the page cache are fetched
        concurrently rather than one page fault after another (``benchmarks/shards.py`` measures both on
        cold shards).
        """
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int(length)
        if starts.size and (starts.min() < 0 or starts.max() + length > len(self)):
            raise IndexError(f"a window of {length} tokens lies outside the {len(self)} tokens.")
        if announce:
            self.prefetch(starts, length)
        g = starts + self._start
        out = np.empty((len(g), length), self.dtype)
        first = np.searchsorted(self._bounds, g, side="right") - 1
        last = np.searchsorted(self._bounds, g + (length - 1), side="right") - 1
        for r in range(len(g)):
            k, lo = int(first[r]), int(g[r])
            if k == last[r]:
                base = int(self._bounds[k])
                out[r] = self._cache.get(k)[lo - base : lo - base + length]
            else:
                out[r] = self._read(lo, lo + length)
        return out


@dataclasses.dataclass(frozen=True)
class ShardSet:
    """An opened shard directory: its manifest and its train and eval streams."""

    path: Path
    manifest: dict
    train: ShardedTokens
    eval: ShardedTokens

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def tokenizer_kind(self) -> str:
        return self.manifest["tokenizer"]["kind"]

    def text_tokenizer(self, sp_model: str | os.PathLike | None = None):
        """The tokenizer the shards were made with, to turn samples back into text, or None.

        ``byte``: :class:`~loco_jax.training.data.tokenizers.ByteTokenizer`. ``sentencepiece``: ``sp_model`` if given,
        else the ``tokenizer.model`` saved beside the shards (its SHA-256 was checked on opening); None when
        that file is gone or the optional ``sentencepiece`` package is missing, so training still runs and
        samples print token ids. Any other kind (shards made elsewhere): None.
        """
        t = self.manifest["tokenizer"]
        if t["kind"] == "byte":
            return ByteTokenizer()
        if t["kind"] != "sentencepiece":
            return None
        model = Path(sp_model).expanduser() if sp_model is not None else _saved_model(self.manifest, self.path)
        if model is None or not model.is_file():
            return None
        try:
            return SentencePieceTokenizer.load(model)
        except ImportError:
            return None

    def describe(self) -> str:
        t = self.manifest["tokenizer"]
        n = len(self.manifest["shards"])
        ev = self.manifest["eval"]
        held = (f"{len(ev['shards'])} eval shard(s)" if "shards" in ev else f"a held-out tail of {ev['tail_tokens']:,}")
        return (f"{n} shard(s) ({self.manifest['dtype']}, {held}); tokenizer {t['kind']} "
                f"(vocabulary {t['vocab_size']}{', sha256 ' + t['sha256'][:12] if t.get('sha256') else ''})")


def _saved_model(manifest: dict, path: Path) -> Path | None:
    """The tokenizer model file saved beside the shards in ``path``, per the manifest (None for bytes)."""
    name = manifest["tokenizer"].get("model_file")
    return Path(path) / name if name else None


def check_tokenizer(manifest: dict, path: str | os.PathLike, *, tokenizer: str | None = None,
                    vocab_size: int | None = None, sp_model: str | os.PathLike | None = None):
    """Refuses shards made with another tokenizer than the config's (``data.tokenizer``,
    ``data.sp_vocab_size``, ``data.sp_model``), where both sides are known.

    The kind is compared for the kinds this project makes (``byte``, ``sentencepiece``); the vocabulary
    with ``vocab_size`` (the byte tokenizer's is 256); the SHA-256 of ``sp_model`` with the manifest's.
    """
    p = Path(path)
    t = manifest["tokenizer"]
    kind, vocab, digest = t["kind"], int(t["vocab_size"]), t.get("sha256")
    own = _saved_model(manifest, p)
    use = (f"--set data.tokenizer={kind}" + (f" --set data.sp_vocab_size={vocab}" if kind == "sentencepiece" else "")
           + (f" --set data.sp_model={own}" if own is not None else "") + f" (and model.vocab_size >= {vocab})")
    if tokenizer is not None and kind in ("byte", "sentencepiece") and tokenizer != kind:
        raise ValueError(
            f"the token shards in {p} were made with the {kind} tokenizer (vocabulary {vocab}), but the config says "
            f"data.tokenizer={tokenizer!r}. Train on them with {use}, or re-tokenize your text with "
            f"`python prepare_data.py --tokenizer {tokenizer} ...`."
        )
    expected = 256 if tokenizer == "byte" else vocab_size
    if expected is not None and kind in ("byte", "sentencepiece") and expected != vocab:
        what = "the byte tokenizer's 256" if tokenizer == "byte" else f"data.sp_vocab_size={expected}"
        raise ValueError(
            f"the token shards in {p} have a vocabulary of {vocab} ({kind}), not {what}. Train on them with {use}, "
            f"or re-tokenize with `python prepare_data.py --vocab-size {expected} ...`."
        )
    if own is not None and own.is_file() and digest and file_sha256(own) != digest:
        raise ValueError(
            f"{own} has SHA-256 {file_sha256(own)}, not the {digest} recorded in {p / MANIFEST}: the tokenizer next "
            f"to the shards was replaced or is corrupt; {remake_hint(manifest, p)}."
        )
    if sp_model is not None:
        model = Path(sp_model).expanduser()
        if not model.is_file():
            raise FileNotFoundError(f"data.sp_model={str(sp_model)!r} does not exist; the shards in {p} were made with "
                                    f"{own if own is not None else 'the ' + kind + ' tokenizer'}.")
        if kind != "sentencepiece" or not digest:
            raise ValueError(f"data.sp_model={str(sp_model)!r} is set, but the token shards in {p} were made with the "
                             f"{kind} tokenizer, not a SentencePiece model; unset data.sp_model or re-tokenize.")
        mine = file_sha256(model)
        if mine != digest:
            raise ValueError(
                f"data.sp_model={str(sp_model)!r} (SHA-256 {mine[:16]}...) is not the tokenizer the shards in {p} were "
                f"made with (SHA-256 {digest[:16]}...{', saved as ' + str(own) if own is not None else ''}). Set "
                f"data.sp_model={own if own is not None else 'THAT_MODEL'}, or re-tokenize with "
                f"`python prepare_data.py --sp-model {sp_model} ...`."
            )


def open_shards(path: str | os.PathLike, *, tokenizer: str | None = None, vocab_size: int | None = None,
                sp_model: str | os.PathLike | None = None) -> ShardSet:
    """Opens shard directory ``path`` (nothing is read but the manifest and file sizes).

    Checks, in order: a manifest is there and well formed; the tokenizer matches (:func:`check_tokenizer`);
    every shard exists and has exactly ``tokens * itemsize`` bytes. ``FileNotFoundError`` or ``ValueError``
    otherwise, naming the file and what to do.
    """
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FileNotFoundError(f"token shard directory {p} does not exist.")
    if not (p / MANIFEST).is_file():
        found = sorted(f.name for f in p.iterdir() if f.is_file())
        raise ValueError(
            f"data directory {p} holds no {MANIFEST}, so it holds no token shards"
            + (f" (it has {', '.join(found[:5])}{', ...' if len(found) > 5 else ''})" if found else " (it is empty)")
            + f". Tokenize your text into it with `python prepare_data.py --input YOUR_TEXT --output {p}`; a single "
            "token file (.npy, .u16.bin, .u32.bin) can be given as data.path directly."
        )
    manifest = read_manifest(p)
    check_tokenizer(manifest, p, tokenizer=tokenizer, vocab_size=vocab_size, sp_model=sp_model)
    dtype = DTYPES[manifest["dtype"]]
    for s in manifest["shards"]:
        f = p / s["file"]
        want = s["tokens"] * dtype.itemsize
        if not f.is_file():
            raise FileNotFoundError(
                f"shard {f} listed in {p / MANIFEST} does not exist: the directory is incomplete (an interrupted "
                f"copy?). Copy the missing file, or {remake_hint(manifest, p)}."
            )
        size = f.stat().st_size
        if size != want:
            what = "truncated" if size < want else "corrupt (too long)"
            raise ValueError(
                f"shard {f} has {size:,} bytes, but {p / MANIFEST} says {s['tokens']:,} tokens x {dtype.itemsize} "
                f"bytes ({manifest['dtype']}) = {want:,}: it is {what}. Copy it again, or {remake_hint(manifest, p)}."
            )
    streams = {}
    for split in SPLITS:
        entries = [s for s in manifest["shards"] if s["split"] == split]
        digest = hashlib.sha256(json.dumps(
            [[s["file"], s["tokens"], s.get("sha256")] for s in entries] + [manifest["dtype"]]).encode()).hexdigest()
        streams[split] = ShardedTokens([p / s["file"] for s in entries], [s["tokens"] for s in entries], dtype,
                                       fingerprint=digest[:16]) if entries else None
    train, ev = streams["train"], streams["eval"]
    if "tail_tokens" in manifest["eval"]:
        n, tail = len(train), manifest["eval"]["tail_tokens"]
        train, ev = train.view(0, n - tail), train.view(n - tail, n)
    return ShardSet(p, manifest, train, ev)


def verify_shards(path: str | os.PathLike, progress: Callable[[int, int], None] | None = None) -> dict:
    """Opens ``path`` and re-reads every shard against its recorded SHA-256 and largest token (slow: reads
    everything); returns the manifest. ``ValueError`` names the first shard that differs. ``progress(done_bytes,
    total_bytes)`` is called as it reads."""
    s = open_shards(path)
    dtype = DTYPES[s.manifest["dtype"]]
    total, done = s.manifest["total_tokens"] * dtype.itemsize, 0
    for entry in s.manifest["shards"]:
        f = s.path / entry["file"]
        h, top = hashlib.sha256(), -1
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                h.update(block)
                top = max(top, int(np.frombuffer(block, dtype).max()))
                done += len(block)
                if progress is not None:
                    progress(done, total)
        if entry.get("sha256") and h.hexdigest() != entry["sha256"]:
            raise ValueError(f"shard {f} has SHA-256 {h.hexdigest()}, not the {entry['sha256']} recorded in the "
                             f"manifest: its contents changed. {remake_hint(s.manifest, s.path).capitalize()}.")
        if entry.get("max_token") is not None and top != entry["max_token"]:
            raise ValueError(f"shard {f} holds token id {top}, the manifest records {entry['max_token']} as its "
                             f"largest: its contents changed. {remake_hint(s.manifest, s.path).capitalize()}.")
    return s.manifest
