"""Token shards: a directory of memory-mapped token files described by a small JSON manifest.

``prepare_data.py`` (:func:`prepare`) tokenizes text into such a directory once; ``data.path`` pointing
at it trains on it (:func:`open_shards`, through :func:`loco_jax.training.data.load_data`)::

    manifest.json           what follows, and how it was made
    train-00000.u16.bin     raw little-endian token ids: *.u16.bin when the vocabulary fits 16 bits,
    train-00001.u16.bin     else *.u32.bin; every shard but a split's last holds exactly
    ...                     shard_tokens tokens
    eval-00000.u16.bin      the held-out documents (absent when eval is a held-out tail)
    tokenizer.model         the SentencePiece model the tokens were made with (absent for bytes)

Manifest (``"version": 1``)::

    {"format": "loco-jax-token-shards", "version": 1, "dtype": "uint16", "total_tokens": 1234567,
     "tokenizer": {"kind": "sentencepiece", "vocab_size": 32000, "sha256": "<of tokenizer.model>",
                   "model_file": "tokenizer.model"},
     "shards": [{"file": "train-00000.u16.bin", "split": "train", "tokens": 134217728, "dtype": "uint16",
                 "sha256": "...", "max_token": 31999}, ...],
     "eval": {"shards": ["eval-00000.u16.bin"]},      # or {"tail_tokens": 6172}
     "documents": {"train": 9900, "eval": 100}, "separator": "\\n\\n", "source": {...}}

Streams
=======
The train stream is the ``"train"`` shards concatenated in manifest order; the eval stream is the
shards ``eval.shards`` names, or, with ``eval.tail_tokens = k``, the last ``k`` tokens of the train
shards (which the train stream then leaves out). Shards are memory-mapped on first use (at most
:data:`OPEN_SHARDS` at a time) and never read whole: :class:`ShardedTokens` is a 1-D, read-only view of
the concatenation that :class:`~loco_jax.training.data.Batcher` and ``eval_windows`` index by global
position, so batches by global sample index, their determinism and the one-integer data position of
a checkpoint are exactly those of a single token file holding the same stream (a test holds it to that).

Loading checks, before anything compiles, that the manifest is well formed, that every shard exists
with exactly ``tokens x itemsize`` bytes, and that the tokenizer matches the config's (kind, vocabulary
and, when ``data.sp_model`` is set, the SHA-256 of the model file); each error names the file and the
fix. :func:`verify_shards` also re-reads every byte against the recorded SHA-256 (slow; not done at start).

Documents and tokenization
==========================
Inputs are ``.txt`` files (one document each) and ``.jsonl`` files (one document per line, the text in a
configurable field), optionally gzipped; a directory contributes its ``*.txt``/``*.jsonl``(``.gz``)
files, recursively, sorted by path. Whitespace-only documents are skipped. Document ``i`` (0-based over
the non-empty documents of all inputs, in order) is held out for evaluation when ``(i + 1) % eval_every
== 0``; when that holds out nothing (fewer than ``eval_every`` documents), the last ``eval_tail`` of the
token stream is held out instead. Within a split, documents are joined by the tokens of
``data.WORK_SEPARATOR`` (a blank line), as :func:`~loco_jax.training.data.load_data` joins works, so the
shards of a corpus hold the tokens that tokenizing each document directly and joining them gives.

A long document is encoded in pieces of about ``piece_chars`` characters, cut after a newline that is
followed by a non-space character; a piece after the first is encoded behind a newline whose tokens
are then dropped. Pieces bound the memory of a large ``.txt`` file and are several times faster for
SentencePiece (its encoding time grows faster than linearly with the input's length), and they give the
same tokens as encoding the whole document: exactly for the byte tokenizer and the SentencePiece models
this project trains (the newline is a user-defined symbol, so no token crosses it), and, for any other
model, :func:`pieces_are_exact` checks it on a sample first and documents are encoded whole otherwise.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import hashlib
import io
import json
import mmap
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from loco_jax.training import data as data_lib

FORMAT = "loco-jax-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.model"
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB as uint16
DEFAULT_EVAL_EVERY = 100  # every 100th document: 1 %
DEFAULT_EVAL_TAIL = data_lib.EVAL_TAIL_FRACTION
DEFAULT_SAMPLE_CHARS = 20_000_000  # characters of text a SentencePiece model is trained on
PIECE_CHARS = 8192
OPEN_SHARDS = 128  # memory maps kept open at once (each holds a file descriptor)
SPLITS = ("train", "eval")

_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
_SUFFIX = {"uint16": ".u16.bin", "uint32": ".u32.bin"}
_READ_BLOCK = 1 << 20
_BATCH_CHARS = 1 << 21  # characters encoded per call (SentencePiece spreads a call over its threads)
_TEXT_SUFFIXES = (".txt", ".txt.gz")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")

__all__ = [
    "DEFAULT_EVAL_EVERY",
    "DEFAULT_SAMPLE_CHARS",
    "DEFAULT_SHARD_TOKENS",
    "FORMAT",
    "MANIFEST",
    "ShardSet",
    "ShardWriter",
    "ShardedTokens",
    "TextProgress",
    "VERSION",
    "check_tokenizer",
    "find_inputs",
    "holds_shard_files",
    "is_shard_dir",
    "iter_pieces",
    "missing_path_message",
    "open_shards",
    "pieces_are_exact",
    "prepare",
    "read_manifest",
    "token_dtype",
    "validate_manifest",
    "verify_shards",
    "write_manifest",
    "write_token_shards",
]


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits 16 bits, else ``"uint32"``."""
    if vocab_size < 1 or vocab_size > 1 << 32:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, 2**32].")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def _sha256_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _remake_hint(manifest: dict | None, path: Path) -> str:
    command = (manifest or {}).get("source", {}).get("command") if isinstance(manifest, dict) else None
    if command:
        return f"re-create the directory with the command that made it: {command}"
    return f"re-create it with `python prepare_data.py --input YOUR_TEXT --output {path}`"


# --------------------------------------------------------------------------------------------------------------------
# The manifest
# --------------------------------------------------------------------------------------------------------------------


def is_shard_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a ``manifest.json``."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / MANIFEST).is_file()


def holds_shard_files(path: str | os.PathLike) -> bool:
    """A directory with token files (``*.bin``, ``*.npy``) but no ``manifest.json`` and no ``.txt`` files:
    shards whose manifest is missing (an interrupted copy?), refused by :func:`open_shards` by name."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / MANIFEST).exists() or any(p.glob("*.txt")):
        return False
    return any(f.suffix.lower() in (".bin", ".npy") for f in p.iterdir() if f.is_file())


def _require(cond: bool, where: Path, what: str, manifest: dict | None = None):
    if not cond:
        raise ValueError(f"manifest {where} is invalid: {what}; {_remake_hint(manifest, where.parent)}.")


def validate_manifest(manifest: dict, where: str | os.PathLike = MANIFEST) -> dict:
    """Checks the structure and the sums of a manifest; returns it. Raises ``ValueError`` naming the field."""
    where = Path(where)
    m = manifest
    _require(isinstance(m, dict), where, "it is not a JSON object")
    _require(m.get("format") == FORMAT, where, f"'format' is {m.get('format')!r}, not {FORMAT!r}", m)
    version = m.get("version")
    _require(isinstance(version, int) and not isinstance(version, bool), where, f"'version' is {version!r}", m)
    if version > VERSION:
        raise ValueError(
            f"manifest {where} has format version {version}; this loco-jax reads versions up to {VERSION}. "
            "Update loco-jax, or re-create the shards with this version's prepare_data.py."
        )
    dtype = m.get("dtype")
    _require(dtype in _DTYPES, where, f"'dtype' is {dtype!r}, not one of {sorted(_DTYPES)}", m)
    tok = m.get("tokenizer")
    _require(isinstance(tok, dict) and isinstance(tok.get("kind"), str), where, "'tokenizer.kind' is missing", m)
    vocab = tok.get("vocab_size")
    _require(isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1, where,
             f"'tokenizer.vocab_size' is {vocab!r}", m)
    _require(vocab <= np.iinfo(_DTYPES[dtype]).max + 1, where,
             f"a vocabulary of {vocab} does not fit the shards' dtype {dtype}", m)
    shards = m.get("shards")
    _require(isinstance(shards, list) and shards, where, "'shards' is empty: the directory holds no shards", m)
    names = set()
    for i, s in enumerate(shards):
        _require(isinstance(s, dict), where, f"shards[{i}] is not an object", m)
        name = s.get("file")
        _require(isinstance(name, str) and name and Path(name).name == name and name not in (".", ".."), where,
                 f"shards[{i}].file is {name!r}, not a plain file name", m)
        _require(name not in names, where, f"shard {name} is listed twice", m)
        names.add(name)
        _require(s.get("split") in SPLITS, where,
                 f"shard {name}: 'split' is {s.get('split')!r}, not one of {SPLITS}", m)
        n = s.get("tokens")
        _require(isinstance(n, int) and not isinstance(n, bool) and n >= 1, where,
                 f"shard {name}: 'tokens' is {n!r}, not a positive integer", m)
        _require(s.get("dtype", dtype) == dtype, where, f"shard {name}: dtype {s.get('dtype')!r} is not {dtype!r}", m)
        top = s.get("max_token")
        if top is not None:
            _require(isinstance(top, int) and 0 <= top < vocab, where,
                     f"shard {name}: max_token {top!r} is not below the vocabulary size {vocab}", m)
    total = sum(s["tokens"] for s in shards)
    _require(m.get("total_tokens") == total, where,
             f"'total_tokens' is {m.get('total_tokens')!r} but the shards hold {total}", m)
    ev = m.get("eval")
    _require(isinstance(ev, dict) and (("shards" in ev) != ("tail_tokens" in ev)), where,
             "'eval' must be {\"shards\": [...]} or {\"tail_tokens\": k}", m)
    train_tokens = sum(s["tokens"] for s in shards if s["split"] == "train")
    _require(train_tokens >= 2, where, "no train shards (the train stream needs at least 2 tokens)", m)
    if "shards" in ev:
        listed = ev["shards"]
        marked = [s["file"] for s in shards if s["split"] == "eval"]
        _require(isinstance(listed, list) and listed == marked, where,
                 f"'eval.shards' {listed!r} is not the list of shards with split 'eval' {marked!r}", m)
        _require(bool(marked), where, "'eval.shards' is empty: there is no eval split", m)
    else:
        tail = ev["tail_tokens"]
        _require(isinstance(tail, int) and not isinstance(tail, bool) and 2 <= tail <= train_tokens - 2, where,
                 f"'eval.tail_tokens' is {tail!r}; it must lie in [2, {train_tokens - 2}] (train tokens - 2)", m)
        _require(not any(s["split"] == "eval" for s in shards), where,
                 "'eval' is a tail but some shards have split 'eval'", m)
    return m


def read_manifest(path: str | os.PathLike) -> dict:
    """The validated manifest of shard directory ``path``."""
    p = Path(path).expanduser()
    f = p / MANIFEST
    if not f.is_file():
        raise FileNotFoundError(f"{p} holds no {MANIFEST}: it is not a token shard directory. "
                                f"{_remake_hint(None, p).capitalize()}.")
    try:
        manifest = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"manifest {f} is not valid JSON (truncated or corrupt?): {e}; "
                         f"{_remake_hint(None, p)}.") from e
    return validate_manifest(manifest, f)


def write_manifest(path: str | os.PathLike, manifest: dict) -> Path:
    """Validates ``manifest`` and writes it to ``path/manifest.json`` atomically (temporary file + rename)."""
    p = Path(path)
    validate_manifest(manifest, p / MANIFEST)
    tmp = p / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, p / MANIFEST)
    return p / MANIFEST


# --------------------------------------------------------------------------------------------------------------------
# Reading: a lazy concatenation of memory-mapped shards
# --------------------------------------------------------------------------------------------------------------------


_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)  # Linux, macOS; elsewhere reads are not announced


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
        if _WILLNEED is None:
            return
        mm = self._entry(k)[0]
        size, page = self.dtype.itemsize, mmap.PAGESIZE
        start = np.asarray(lo, np.int64) * size // page * page
        stop = np.minimum(np.asarray(hi, np.int64) * size, len(mm))
        for a, n in zip(start.tolist(), (stop - start).tolist()):
            mm.madvise(_WILLNEED, a, n)


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
        rows are copied. :class:`~loco_jax.training.data.Batcher` announces the next batch's rows this way,
        so their reads overlap the current step."""
        starts = np.asarray(starts, dtype=np.int64).reshape(-1)
        length = int(length)
        if not starts.size or _WILLNEED is None or length < 1:
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

        ``byte``: :class:`~loco_jax.training.data.ByteTokenizer`. ``sentencepiece``: ``sp_model`` if given,
        else the ``tokenizer.model`` saved beside the shards (its SHA-256 was checked on opening); None when
        that file is gone or the optional ``sentencepiece`` package is missing, so training still runs and
        samples print token ids. Any other kind (shards made elsewhere): None.
        """
        t = self.manifest["tokenizer"]
        if t["kind"] == "byte":
            return data_lib.ByteTokenizer()
        if t["kind"] != "sentencepiece":
            return None
        model = Path(sp_model).expanduser() if sp_model is not None else _saved_model(self.manifest, self.path)
        if model is None or not model.is_file():
            return None
        try:
            return data_lib.SentencePieceTokenizer.load(model)
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


def _file_sha256(path: Path) -> str:
    return data_lib._sha256(path)


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
    if own is not None and own.is_file() and digest and _file_sha256(own) != digest:
        raise ValueError(
            f"{own} has SHA-256 {_file_sha256(own)}, not the {digest} recorded in {p / MANIFEST}: the tokenizer next "
            f"to the shards was replaced or is corrupt; {_remake_hint(manifest, p)}."
        )
    if sp_model is not None:
        model = Path(sp_model).expanduser()
        if not model.is_file():
            raise FileNotFoundError(f"data.sp_model={str(sp_model)!r} does not exist; the shards in {p} were made with "
                                    f"{own if own is not None else 'the ' + kind + ' tokenizer'}.")
        if kind != "sentencepiece" or not digest:
            raise ValueError(f"data.sp_model={str(sp_model)!r} is set, but the token shards in {p} were made with the "
                             f"{kind} tokenizer, not a SentencePiece model; unset data.sp_model or re-tokenize.")
        mine = _file_sha256(model)
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
    dtype = _DTYPES[manifest["dtype"]]
    for s in manifest["shards"]:
        f = p / s["file"]
        want = s["tokens"] * dtype.itemsize
        if not f.is_file():
            raise FileNotFoundError(
                f"shard {f} listed in {p / MANIFEST} does not exist: the directory is incomplete (an interrupted "
                f"copy?). Copy the missing file, or {_remake_hint(manifest, p)}."
            )
        size = f.stat().st_size
        if size != want:
            what = "truncated" if size < want else "corrupt (too long)"
            raise ValueError(
                f"shard {f} has {size:,} bytes, but {p / MANIFEST} says {s['tokens']:,} tokens x {dtype.itemsize} "
                f"bytes ({manifest['dtype']}) = {want:,}: it is {what}. Copy it again, or {_remake_hint(manifest, p)}."
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
    dtype = _DTYPES[s.manifest["dtype"]]
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
                             f"manifest: its contents changed. {_remake_hint(s.manifest, s.path).capitalize()}.")
        if entry.get("max_token") is not None and top != entry["max_token"]:
            raise ValueError(f"shard {f} holds token id {top}, the manifest records {entry['max_token']} as its "
                             f"largest: its contents changed. {_remake_hint(s.manifest, s.path).capitalize()}.")
    return s.manifest


# --------------------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------------------


class ShardWriter:
    """Writes one split's token stream as consecutive shards of ``shard_tokens`` tokens (the last one shorter).

    ``write(tokens)`` appends; ``close()`` returns the manifest entries (file, split, tokens, dtype, sha256,
    max_token). Files are ``<split>-<index:05d>.u16.bin`` (or ``.u32.bin``) in ``directory``.
    """

    def __init__(self, directory: str | os.PathLike, split: str, dtype: str, shard_tokens: int = DEFAULT_SHARD_TOKENS):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}.")
        if shard_tokens < 2:
            raise ValueError(f"shard_tokens={shard_tokens} must be at least 2.")
        self.directory, self.split, self.dtype_name = Path(directory), split, dtype
        self.dtype, self.shard_tokens = _DTYPES[dtype], int(shard_tokens)
        self.entries: list[dict] = []
        self.tokens = 0
        self._file = None

    def _open(self):
        name = f"{self.split}-{len(self.entries):05d}{_SUFFIX[self.dtype_name]}"
        self._file = open(self.directory / name, "wb")
        self._name, self._count, self._hash, self._max = name, 0, hashlib.sha256(), -1

    def _finish(self):
        self._file.close()
        self._file = None
        self.entries.append({"file": self._name, "split": self.split, "tokens": self._count,
                             "dtype": self.dtype_name, "sha256": self._hash.hexdigest(), "max_token": self._max})

    def write(self, tokens) -> None:
        tokens = np.asarray(tokens)
        if tokens.size == 0:
            return
        if tokens.dtype.kind not in "iu":
            raise TypeError(f"token ids must be integers, got {tokens.dtype}.")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi > np.iinfo(self.dtype).max:
            raise ValueError(f"token ids [{lo}, {hi}] do not fit the shards' dtype {self.dtype_name}.")
        tokens = tokens.reshape(-1).astype(self.dtype, copy=False)
        while tokens.size:
            if self._file is None:
                self._open()
            take = tokens[: self.shard_tokens - self._count]
            raw = take.tobytes()
            self._file.write(raw)
            self._hash.update(raw)
            self._max = max(self._max, int(take.max()))
            self._count += take.size
            self.tokens += take.size
            tokens = tokens[take.size :]
            if self._count == self.shard_tokens:
                self._finish()

    def close(self) -> list[dict]:
        if self._file is not None:
            self._finish()
        return self.entries


def _tokenizer_entry(kind: str, vocab_size: int, model_proto: bytes | None) -> dict:
    if model_proto is None:
        return {"kind": kind, "vocab_size": int(vocab_size), "sha256": None, "model_file": None}
    return {"kind": kind, "vocab_size": int(vocab_size), "sha256": _sha256_bytes(model_proto),
            "model_file": TOKENIZER_FILE}


def _manifest(dtype: str, tokenizer: dict, train: list[dict], held: list[dict], tail: int, documents: dict,
              source: dict) -> dict:
    shards = train + held
    return {
        "format": FORMAT, "version": VERSION, "dtype": dtype,
        "total_tokens": int(sum(s["tokens"] for s in shards)),
        "tokenizer": tokenizer,
        "shards": shards,
        "eval": {"shards": [s["file"] for s in held]} if held else {"tail_tokens": int(tail)},
        "documents": documents,
        "separator": data_lib.WORK_SEPARATOR,
        "source": source,
    }


def write_token_shards(
    path: str | os.PathLike, train_tokens, eval_tokens=None, *, vocab_size: int, tokenizer: str = "external",
    model_proto: bytes | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS, eval_tail: float = DEFAULT_EVAL_TAIL,
) -> dict:
    """Writes token arrays as a shard directory (for tokens made elsewhere; ``prepare`` for text).

    ``eval_tokens`` None holds out the last ``eval_tail`` of ``train_tokens`` as a tail. ``tokenizer`` names
    the kind (``"external"`` for ids from a tokenizer this project does not know; only the vocabulary is
    then checked). Returns the manifest.
    """
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(vocab_size)
    train = np.asarray(train_tokens).reshape(-1)
    if train.size and int(train.max()) >= vocab_size:
        raise ValueError(f"train tokens hold id {int(train.max())}, not below vocab_size {vocab_size}.")
    w = ShardWriter(p, "train", dtype, shard_tokens)
    w.write(train)
    held, tail = [], 0
    if eval_tokens is not None:
        ev = np.asarray(eval_tokens).reshape(-1)
        if ev.size and int(ev.max()) >= vocab_size:
            raise ValueError(f"eval tokens hold id {int(ev.max())}, not below vocab_size {vocab_size}.")
        we = ShardWriter(p, "eval", dtype, shard_tokens)
        we.write(ev)
        held = we.close()
    else:
        tail = _tail_tokens(train.size, eval_tail)
    if model_proto is not None:
        (p / TOKENIZER_FILE).write_bytes(model_proto)
    manifest = _manifest(dtype, _tokenizer_entry(tokenizer, vocab_size, model_proto), w.close(), held, tail,
                         {}, {"writer": "write_token_shards"})
    write_manifest(p, manifest)
    return manifest


def _tail_tokens(n: int, fraction: float) -> int:
    if not 0 < fraction < 1:
        raise ValueError(f"eval tail fraction must lie in (0, 1), got {fraction}.")
    if n < 4:
        raise ValueError(f"a stream of {n} tokens is too short to hold out a tail (needs at least 4).")
    return max(2, min(n - 2, int(round(n * fraction))))


# --------------------------------------------------------------------------------------------------------------------
# Inputs: files, documents, pieces
# --------------------------------------------------------------------------------------------------------------------


def _kind(path: Path) -> str:
    name = path.name.lower()
    return "jsonl" if name.endswith(_JSONL_SUFFIXES) else "text"


def find_inputs(inputs: Sequence[str | os.PathLike]) -> list[Path]:
    """The input files, in order: files as given (``*.jsonl``/``*.jsonl.gz`` are JSON lines, anything else
    text), then each directory's ``*.txt``, ``*.jsonl`` (and ``.gz``) files, recursively, sorted by path
    (hidden files and folders skipped)."""
    if isinstance(inputs, (str, os.PathLike)):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no input given: pass text files, .jsonl files or directories of them.")
    files: list[Path] = []
    for item in inputs:
        p = Path(item).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"input {p} does not exist.")
        if p.is_dir():
            found = sorted(
                f for f in p.rglob("*")
                if f.is_file() and f.name.lower().endswith(_TEXT_SUFFIXES + _JSONL_SUFFIXES)
                and not any(part.startswith(".") for part in f.relative_to(p).parts)
            )
            if not found:
                raise ValueError(f"input directory {p} holds no .txt or .jsonl files (searched recursively).")
            files += found
        elif p.suffix.lower() in (".npy", ".bin"):
            raise ValueError(f"input {p} is a token file, not text; train on it directly with --set data.path={p}.")
        else:
            files.append(p)
    seen, unique = set(), []
    for f in files:  # a file named twice (a file and its folder) is read once
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


class _Counting(io.RawIOBase):
    """A raw reader that reports the bytes it reads (progress over compressed files too)."""

    def __init__(self, f, on_bytes):
        self._f, self._on_bytes = f, on_bytes

    def readable(self):
        return True

    def readinto(self, b):
        n = self._f.readinto(b)
        if n and self._on_bytes is not None:
            self._on_bytes(n)
        return n

    def close(self):
        self._f.close()
        super().close()


def _open(path: Path, on_bytes):
    raw = io.BufferedReader(_Counting(open(path, "rb", buffering=0), on_bytes), buffer_size=_READ_BLOCK)
    if path.name.lower().endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return raw


def _cut(text: str, piece_chars: int | None, final: bool) -> tuple[list[str], str]:
    """Pieces of ``text`` of at least ``piece_chars`` characters, each ending at a newline followed by a
    non-space character; returns (pieces, the remainder). ``final``: the remainder is the last piece."""
    pieces, start, n = [], 0, len(text)
    if piece_chars is not None:
        while n - start > piece_chars:
            i = text.find("\n", start + piece_chars - 1)
            while i != -1 and i + 1 < n and text[i + 1].isspace():
                i = text.find("\n", i + 1)
            if i == -1 or i + 1 >= n:
                break  # no cut yet: what follows the newline is not known
            pieces.append(text[start : i + 1])
            start = i + 1
    rest = text[start:]
    if final:
        if rest:
            pieces.append(rest)
        rest = ""
    return pieces, rest


def _text_pieces(path: Path, piece_chars: int | None, on_bytes) -> Iterator[str]:
    """A text file's pieces: read in blocks cut at newlines (UTF-8 safe, ``\\r\\n`` kept together), decoded as
    :func:`loco_jax.training.data.load_data` decodes a file (UTF-8, else Latin-1; newlines normalized).
    Nothing for a whitespace-only file."""
    buf, rest, seen = "", b"", False
    with _open(path, on_bytes) as f:
        while True:
            block = f.read(_READ_BLOCK)
            if block:
                raw = rest + block
                cut = raw.rfind(b"\n") + 1
                if cut == 0:
                    rest = raw
                    continue
                text, rest = data_lib._decode(raw[:cut]), raw[cut:]
            else:
                text, rest = (data_lib._decode(rest) if rest else ""), b""
            buf += text
            if not seen:
                seen = bool(buf.strip())
            if seen:
                pieces, buf = _cut(buf, piece_chars, final=not block)
                yield from pieces
            if not block:
                return


def _jsonl_texts(path: Path, field: str, on_bytes) -> Iterator[str]:
    with _open(path, on_bytes) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno} is not valid JSON ({e}); each line of a .jsonl file must be one "
                                 "JSON object.") from e
            if not isinstance(obj, dict) or field not in obj:
                fields = sorted(obj)[:10] if isinstance(obj, dict) else type(obj).__name__
                raise ValueError(f"{path}:{lineno} has no {field!r} field (it has {fields}); pass the field that "
                                 "holds the text with --text-field NAME.")
            text = obj[field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {field!r} is a {type(text).__name__}, not a string.")
            yield text.replace("\r\n", "\n").replace("\r", "\n")


def iter_pieces(files: Sequence[Path], *, text_field: str = "text", piece_chars: int | None = PIECE_CHARS,
                on_bytes: Callable[[int], None] | None = None) -> Iterator[tuple[int, bool, str]]:
    """``(document index, first piece of its document?, text)`` over the non-empty documents of ``files``
    (a ``.txt`` file is one document, a ``.jsonl`` line another); ``piece_chars=None`` yields whole documents."""
    doc = 0
    for path in files:
        if _kind(path) == "jsonl":
            for text in _jsonl_texts(path, text_field, on_bytes):
                if not text.strip():
                    continue
                pieces, _ = _cut(text, piece_chars, final=True)
                for j, piece in enumerate(pieces):
                    yield doc, j == 0, piece
                doc += 1
        else:
            any_piece = False
            for j, piece in enumerate(_text_pieces(path, piece_chars, on_bytes)):
                yield doc, j == 0, piece
                any_piece = True
            doc += any_piece


class _Encoder:
    """Encodes pieces: a later piece of a document behind a newline whose tokens are dropped (module docstring)."""

    def __init__(self, tok, threads: int | None):
        self.tok, self.threads = tok, threads
        self.prefix = [int(i) for i in tok.encode("\n")]

    def __call__(self, pieces: Sequence[tuple[bool, str]]) -> list[np.ndarray]:
        texts = [t if first else "\n" + t for first, t in pieces]
        batch = getattr(self.tok, "encode_batch", None)
        ids = batch(texts, num_threads=self.threads) if batch else [self.tok.encode(t) for t in texts]
        k = len(self.prefix)
        out = []
        for (first, _), arr in zip(pieces, ids):
            arr = np.asarray(arr)
            if not first:
                if arr[:k].tolist() != self.prefix:
                    raise RuntimeError("a piece's newline context did not encode to the newline's tokens; encode "
                                       "documents whole (prepare(..., piece_chars=None)).")
                arr = arr[k:]
            out.append(arr)
        return out


def pieces_are_exact(tok, texts: Iterable[str], piece_chars: int = 256, max_chars: int = 200_000) -> bool:
    """Whether encoding ``texts`` in pieces (cut every ~``piece_chars``) gives the tokens of encoding each
    whole, on up to ``max_chars`` characters of them: the check that lets :func:`prepare` use pieces."""
    enc, seen = _Encoder(tok, 1), 0
    for text in texts:
        text = text[: max(0, max_chars - seen)]
        if not text:
            break
        seen += len(text)
        pieces, _ = _cut(text, piece_chars, final=True)
        try:
            parts = enc([(j == 0, p) for j, p in enumerate(pieces)])
        except RuntimeError:
            return False
        if not np.array_equal(np.concatenate(parts), np.asarray(tok.encode(text))):
            return False
    return True


# --------------------------------------------------------------------------------------------------------------------
# Progress
# --------------------------------------------------------------------------------------------------------------------


class TextProgress:
    """Progress of :func:`prepare`: one line updated in place on a terminal, a plain line every ``every_s``
    seconds otherwise (logs, CI). No dependency."""

    def __init__(self, stream=None, *, every_s: float | None = None):
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = every_s if every_s is not None else (0.2 if self.tty else 30.0)
        self._last, self._t0, self._phase, self._open = 0.0, time.perf_counter(), None, False

    def __call__(self, phase: str, done: int, total: int, tokens: int = 0, shards: int = 0, final: bool = False):
        now = time.perf_counter()
        if phase != self._phase:
            self._end_line()
            self._phase, self._t0, self._last = phase, now, now
        if not final and now - self._last < self.every_s:
            return
        self._last = now
        dt = max(now - self._t0, 1e-9)
        frac = min(1.0, done / total) if total else 0.0
        eta = (dt / frac - dt) if 0 < frac < 1 else 0.0
        text = (f"{phase}: {frac:6.1%} {done / 2**20:,.1f}/{total / 2**20:,.1f} MiB, {done / 2**20 / dt:,.2f} MiB/s"
                + (f", {tokens:,} tokens ({tokens / dt:,.0f}/s), {shards} shard(s)" if tokens else "")
                + (f", {_hms(eta)} left" if eta else f", {_hms(dt)}"))
        if self.tty:
            width = 24
            bar = "#" * int(width * frac) + "." * (width - int(width * frac))
            self.stream.write(f"\r[{bar}] {text}   ")
            self._open = True
            if final:
                self._end_line()
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _end_line(self):
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

    def close(self):
        self._end_line()


def _hms(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


# --------------------------------------------------------------------------------------------------------------------
# prepare: text -> shards
# --------------------------------------------------------------------------------------------------------------------


def _is_eval(doc: int, eval_every: int) -> bool:
    return (doc + 1) % eval_every == 0


def _sample(files, text_field, eval_every, sample_chars, total_bytes, on_bytes) -> list[str]:
    """Pieces of the training documents spread evenly over the input, about ``sample_chars`` characters."""
    rate = min(1.0, sample_chars / max(1, total_bytes))
    out, taken, credit = [], 0, 0.0
    for doc, _, text in iter_pieces(files, text_field=text_field, on_bytes=on_bytes):
        if _is_eval(doc, eval_every):
            continue
        credit += rate * len(text)
        if credit >= len(text) or rate >= 1.0:
            credit -= len(text)
            out.append(text)
            taken += len(text)
            if taken >= sample_chars:
                break
    return out


def prepare(
    inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *, tokenizer: str = "sentencepiece",
    vocab_size: int | None = None, sp_model: str | os.PathLike | None = None,
    sample_chars: int = DEFAULT_SAMPLE_CHARS, shard_tokens: int = DEFAULT_SHARD_TOKENS,
    eval_every: int = DEFAULT_EVAL_EVERY, eval_tail: float = DEFAULT_EVAL_TAIL, text_field: str = "text",
    threads: int | None = None, piece_chars: int | None = PIECE_CHARS, overwrite: bool = False,
    progress: Callable | None = None, command: str | None = None, log: Callable[[str], None] = print,
) -> dict:
    """Tokenizes ``inputs`` into a shard directory at ``output``; returns its manifest.

    ``tokenizer``: ``"byte"``, or ``"sentencepiece"`` with either ``sp_model`` (an existing model file) or
    ``vocab_size`` (a BPE model trained on ``sample_chars`` characters of the training documents, spread
    over the input). ``shard_tokens`` per shard; uint16 when the vocabulary fits, else uint32. Eval: every
    ``eval_every``-th document, else the last ``eval_tail`` of the stream (module docstring). ``threads``:
    SentencePiece encoding threads (None: every core). The directory is written under a temporary name next
    to ``output`` and renamed into place when complete, so an interrupted run leaves no half directory;
    an existing ``output`` is replaced only with ``overwrite``. ``progress(phase, done_bytes, total_bytes,
    tokens, shards, final)`` is called as it goes (:class:`TextProgress` prints it). ``command`` is recorded
    in the manifest (error messages quote it).
    """
    t_start = time.perf_counter()
    kind = tokenizer.lower()
    if kind in ("spm", "bpe"):
        kind = "sentencepiece"
    if kind not in ("byte", "sentencepiece"):
        raise ValueError(f"tokenizer={tokenizer!r} must be 'byte' or 'sentencepiece'.")
    if kind == "byte" and (sp_model is not None):
        raise ValueError("sp_model is a SentencePiece model; it needs tokenizer='sentencepiece'.")
    if kind == "sentencepiece" and sp_model is None and not vocab_size:
        raise ValueError("a SentencePiece tokenizer needs vocab_size (to train one) or sp_model (an existing one).")
    if not isinstance(eval_every, int) or eval_every < 2:
        raise ValueError(f"eval_every={eval_every!r} must be an integer >= 2 (every eval_every-th document is held "
                         "out).")
    if not 0 < eval_tail < 1:
        raise ValueError(f"eval_tail={eval_tail!r} must lie in (0, 1).")
    if shard_tokens < 1024:
        raise ValueError(f"shard_tokens={shard_tokens} must be at least 1024.")
    files = find_inputs(inputs)
    out = Path(output).expanduser()
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(f"output {out} already exists; pass --overwrite to replace it, or choose another "
                              "--output.")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {out} is a file, not a directory; choose another --output.")
    for f in files:
        if out.resolve() in f.resolve().parents:
            raise ValueError(f"input {f} lies inside the output directory {out}; choose an --output outside the input.")
    total_bytes = sum(f.stat().st_size for f in files)
    progress = progress or (lambda *a, **k: None)
    log(f"{len(files)} input file(s), {total_bytes / 1e6:,.1f} MB -> {out} ({kind} tokenizer)")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # ---- the tokenizer
        done = [0]

        def counter(phase):
            def on_bytes(n):
                done[0] += n
                progress(phase, done[0], total_bytes)
            return on_bytes

        sample: list[str] = []
        if kind == "byte":
            tok, proto = data_lib.ByteTokenizer(), None
        elif sp_model is not None:
            tok = data_lib.SentencePieceTokenizer.load(Path(sp_model).expanduser())
            proto = tok.proto
            if vocab_size and vocab_size != tok.vocab_size:
                raise ValueError(f"SentencePiece model {sp_model} has a vocabulary of {tok.vocab_size}, not the "
                                 f"{vocab_size} asked for; drop --vocab-size or pass --vocab-size {tok.vocab_size}.")
        else:
            sample = _sample(files, text_field, eval_every, sample_chars, total_bytes, counter("sampling"))
            progress("sampling", done[0], total_bytes, final=True)
            if not sample:
                raise ValueError(f"the inputs ({', '.join(map(str, files[:3]))}{', ...' if len(files) > 3 else ''}) "
                                 "hold no training text to train a tokenizer on.")
            t0 = time.perf_counter()
            log(f"training a {vocab_size}-piece SentencePiece BPE model on {sum(map(len, sample)):,} characters "
                f"({len(sample):,} pieces) ...")
            try:
                tok = data_lib.SentencePieceTokenizer.train(sample, int(vocab_size))
            except RuntimeError as e:  # SentencePiece's own refusal, e.g. a vocabulary too large for the text
                raise ValueError(
                    f"SentencePiece could not train a {vocab_size}-piece model on {sum(map(len, sample)):,} characters "
                    f"({str(e).split('] ')[-1]}); pass a smaller --vocab-size or more text (--sample-chars)."
                ) from e
            proto = tok.proto
            log(f"trained in {time.perf_counter() - t0:.1f} s")
        if proto is not None:
            (tmp / TOKENIZER_FILE).write_bytes(proto)
        vocab = int(tok.vocab_size)
        dtype = token_dtype(vocab)
        if kind == "sentencepiece" and piece_chars is not None:
            check = sample or [t for _, _, t in _take(iter_pieces(files, text_field=text_field, piece_chars=1 << 16),
                                                      8)]
            if not pieces_are_exact(tok, check):
                log("note: this SentencePiece model does not split at newlines; documents are encoded whole")
                piece_chars = None

        # ---- pass over the input: encode and write
        t_encode = time.perf_counter()
        done[0] = 0
        writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
        docs = {s: 0 for s in SPLITS}
        sep = np.asarray(tok.encode(data_lib.WORK_SEPARATOR))
        encode = _Encoder(tok, threads)

        def shards_done():
            return sum(len(w.entries) for w in writers.values())

        def flush(batch):
            for (doc, first, _), ids in zip(batch, encode([(f, t) for _, f, t in batch])):
                split = "eval" if _is_eval(doc, eval_every) else "train"
                if first:
                    if docs[split]:
                        writers[split].write(sep)
                    docs[split] += 1
                writers[split].write(ids)
            progress("tokenizing", done[0], total_bytes, writers["train"].tokens + writers["eval"].tokens,
                     shards_done())

        on_bytes = counter("tokenizing")
        batch, chars = [], 0
        for item in iter_pieces(files, text_field=text_field, piece_chars=piece_chars, on_bytes=on_bytes):
            batch.append(item)
            chars += len(item[2])
            if chars >= _BATCH_CHARS:
                flush(batch)
                batch, chars = [], 0
        if batch:
            flush(batch)
        train, held = writers["train"].close(), writers["eval"].close()
        n_train = writers["train"].tokens
        progress("tokenizing", total_bytes, total_bytes, n_train + writers["eval"].tokens, shards_done(), final=True)
        if not train:
            raise ValueError(f"the inputs ({', '.join(map(str, files[:3]))}{', ...' if len(files) > 3 else ''}) hold "
                             "no text (every document is empty or held out).")
        tail = 0
        if not held:
            tail = _tail_tokens(n_train, eval_tail)
        seconds = time.perf_counter() - t_encode
        source = {
            "inputs": [str(f) for f in files], "input_bytes": total_bytes, "text_field": text_field,
            "eval_every": eval_every, "eval_tail": eval_tail, "shard_tokens": shard_tokens,
            "piece_chars": piece_chars, "sample_chars": sum(map(len, sample)) if sample else None,
            "command": command, "seconds": round(seconds, 3),
        }
        manifest = _manifest(dtype, _tokenizer_entry(kind, vocab, proto), train, held, tail,
                             {"train": docs["train"], "eval": docs["eval"]}, source)
        write_manifest(tmp, manifest)
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = manifest["total_tokens"]
    log(f"wrote {len(manifest['shards'])} shard(s) to {out}: {total:,} tokens ({n_train - tail:,} train, "
        f"{total - n_train + tail:,} eval; {docs['train']:,} + {docs['eval']:,} documents), {dtype}, "
        f"{kind} vocabulary {vocab}; {total / max(seconds, 1e-9):,.0f} tokens/s, "
        f"{time.perf_counter() - t_start:.1f} s in all")
    return manifest


def _take(it, n):
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


# --------------------------------------------------------------------------------------------------------------------
# The refusal of pod recipes without data
# --------------------------------------------------------------------------------------------------------------------


def missing_path_message(tokenizer: str = "sentencepiece", vocab_size: int | None = None,
                         output: str = "/data/shards") -> str:
    """What a config with ``data.require_path`` says when ``data.path`` is unset: the prepare_data.py command
    for its tokenizer, then the ``--set`` flags that train on the result."""
    if tokenizer == "sentencepiece":
        prep = (f"python prepare_data.py --input /path/to/your/corpus --output {output} --tokenizer sentencepiece "
                f"--vocab-size {vocab_size}")
        flags = f"--set data.path={output} --set data.sp_model={output}/{TOKENIZER_FILE}"
    else:
        prep = f"python prepare_data.py --input /path/to/your/corpus --output {output} --tokenizer byte"
        flags = f"--set data.path={output}"
    return (
        "data.path is not set, and this config (data.require_path=True) refuses to train on the built-in Shakespeare "
        "demo text: it is sized for a real corpus. Tokenize yours once (text files, .jsonl files with a \"text\" "
        "field, or directories of them) into memory-mapped shards:\n\n"
        f"    {prep}\n\n"
        f"then add to the train.py command (the same on every host):\n\n    {flags}\n"
    )
