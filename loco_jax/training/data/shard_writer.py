"""Writing token shards: fixed-size shard files with their SHA-256, and the manifest that describes them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from loco_jax.training.data.corpus import WORK_SEPARATOR
from loco_jax.training.data.shard_format import (
    DEFAULT_EVAL_TAIL, DEFAULT_SHARD_TOKENS, FORMAT, SPLITS, TOKENIZER_FILE, VERSION, DTYPES, SUFFIXES,
    sha256_bytes, token_dtype, write_manifest,
)


class ShardWriter:
    """Writes one split's token stream as consecutive shards of ``shard_tokens`` tokens (the last one shorter).

    ``write(tokens)`` appends; ``close()`` returns the manifest entries (file, split, tokens, dtype, sha256,
    max_token). Files are ``<split>-<index:05d>.u16.bin`` (or ``.u32.bin``) in ``directory``.
    """

    def __init__(self, directory: str | os.PathLike, split: str, dtype: str, shard_tokens: int = DEFAULT_SHARD_TOKENS):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}.")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}.")
        if shard_tokens < 2:
            raise ValueError(f"shard_tokens={shard_tokens} must be at least 2.")
        self.directory, self.split, self.dtype_name = Path(directory), split, dtype
        self.dtype, self.shard_tokens = DTYPES[dtype], int(shard_tokens)
        self.entries: list[dict] = []
        self.tokens = 0
        self._file = None

    def _open(self):
        name = f"{self.split}-{len(self.entries):05d}{SUFFIXES[self.dtype_name]}"
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


def tokenizer_entry(kind: str, vocab_size: int, model_proto: bytes | None) -> dict:
    if model_proto is None:
        return {"kind": kind, "vocab_size": int(vocab_size), "sha256": None, "model_file": None}
    return {"kind": kind, "vocab_size": int(vocab_size), "sha256": sha256_bytes(model_proto),
            "model_file": TOKENIZER_FILE}


def build_manifest(dtype: str, tokenizer: dict, train: list[dict], held: list[dict], tail: int, documents: dict,
              source: dict) -> dict:
    shards = train + held
    return {
        "format": FORMAT, "version": VERSION, "dtype": dtype,
        "total_tokens": int(sum(s["tokens"] for s in shards)),
        "tokenizer": tokenizer,
        "shards": shards,
        "eval": {"shards": [s["file"] for s in held]} if held else {"tail_tokens": int(tail)},
        "documents": documents,
        "separator": WORK_SEPARATOR,
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
        tail = tail_tokens(train.size, eval_tail)
    if model_proto is not None:
        (p / TOKENIZER_FILE).write_bytes(model_proto)
    manifest = build_manifest(dtype, tokenizer_entry(tokenizer, vocab_size, model_proto), w.close(), held, tail,
                         {}, {"writer": "write_token_shards"})
    write_manifest(p, manifest)
    return manifest


def tail_tokens(n: int, fraction: float) -> int:
    if not 0 < fraction < 1:
        raise ValueError(f"eval tail fraction must lie in (0, 1), got {fraction}.")
    if n < 4:
        raise ValueError(f"a stream of {n} tokens is too short to hold out a tail (needs at least 4).")
    return max(2, min(n - 2, int(round(n * fraction))))
