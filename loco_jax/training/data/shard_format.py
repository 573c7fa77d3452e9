"""The token shard format: a directory of memory-mapped token files described by a small JSON manifest.

``prepare_data.py`` (:func:`prepare`) tokenizes text into such a directory once; ``data.path`` pointing
at it trains on it (:func:`open_shards`, through :func:`loco_jax.training.data.tokens.load_data`)::

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
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from loco_jax.training.data.corpus import EVAL_TAIL_FRACTION

FORMAT = "loco-jax-token-shards"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.model"
DEFAULT_SHARD_TOKENS = 1 << 27  # 128 Mi tokens: 256 MiB as uint16
DEFAULT_EVAL_EVERY = 100  # every 100th document: 1 %
DEFAULT_EVAL_TAIL = EVAL_TAIL_FRACTION
DEFAULT_SAMPLE_CHARS = 20_000_000  # characters of text a SentencePiece model is trained on
PIECE_CHARS = 8192
OPEN_SHARDS = 128  # memory maps kept open at once (each holds a file descriptor)
SPLITS = ("train", "eval")

DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}  # token ids on disk, little-endian
SUFFIXES = {"uint16": ".u16.bin", "uint32": ".u32.bin"}
READ_BLOCK = 1 << 20


def token_dtype(vocab_size: int) -> str:
    """``"uint16"`` when every id of a ``vocab_size`` vocabulary fits 16 bits, else ``"uint32"``."""
    if vocab_size < 1 or vocab_size > 1 << 32:
        raise ValueError(f"vocab_size={vocab_size} must lie in [1, 2**32].")
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def sha256_bytes(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def remake_hint(manifest: dict | None, path: Path) -> str:
    command = (manifest or {}).get("source", {}).get("command") if isinstance(manifest, dict) else None
    if command:
        return f"re-create the directory with the command that made it: {command}"
    return f"re-create it with `python prepare_data.py --input YOUR_TEXT --output {path}`"




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
        raise ValueError(f"manifest {where} is invalid: {what}; {remake_hint(manifest, where.parent)}.")


def _check_shard_entry(i, s, names, dtype, vocab, where, m) -> str:
    """Checks ``shards[i]`` of manifest ``m`` (``names``: the files listed before it); returns its file name."""
    _require(isinstance(s, dict), where, f"shards[{i}] is not an object", m)
    name = s.get("file")
    _require(isinstance(name, str) and name and Path(name).name == name and name not in (".", ".."), where,
             f"shards[{i}].file is {name!r}, not a plain file name", m)
    _require(name not in names, where, f"shard {name} is listed twice", m)
    _require(s.get("split") in SPLITS, where, f"shard {name}: 'split' is {s.get('split')!r}, not one of {SPLITS}", m)
    n = s.get("tokens")
    _require(isinstance(n, int) and not isinstance(n, bool) and n >= 1, where,
             f"shard {name}: 'tokens' is {n!r}, not a positive integer", m)
    _require(s.get("dtype", dtype) == dtype, where, f"shard {name}: dtype {s.get('dtype')!r} is not {dtype!r}", m)
    top = s.get("max_token")
    if top is not None:
        _require(isinstance(top, int) and 0 <= top < vocab, where,
                 f"shard {name}: max_token {top!r} is not below the vocabulary size {vocab}", m)
    return name


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
    _require(dtype in DTYPES, where, f"'dtype' is {dtype!r}, not one of {sorted(DTYPES)}", m)
    tok = m.get("tokenizer")
    _require(isinstance(tok, dict) and isinstance(tok.get("kind"), str), where, "'tokenizer.kind' is missing", m)
    vocab = tok.get("vocab_size")
    _require(isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= 1, where,
             f"'tokenizer.vocab_size' is {vocab!r}", m)
    _require(vocab <= np.iinfo(DTYPES[dtype]).max + 1, where,
             f"a vocabulary of {vocab} does not fit the shards' dtype {dtype}", m)
    shards = m.get("shards")
    _require(isinstance(shards, list) and shards, where, "'shards' is empty: the directory holds no shards", m)
    names = set()
    for i, s in enumerate(shards):
        names.add(_check_shard_entry(i, s, names, dtype, vocab, where, m))
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
                                f"{remake_hint(None, p).capitalize()}.")
    try:
        manifest = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"manifest {f} is not valid JSON (truncated or corrupt?): {e}; "
                         f"{remake_hint(None, p)}.") from e
    return validate_manifest(manifest, f)


def write_manifest(path: str | os.PathLike, manifest: dict) -> Path:
    """Validates ``manifest`` and writes it to ``path/manifest.json`` atomically (temporary file + rename)."""
    p = Path(path)
    validate_manifest(manifest, p / MANIFEST)
    tmp = p / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, p / MANIFEST)
    return p / MANIFEST
