"""Tokenizers: bytes (the default, no training) and SentencePiece BPE (trained on a run's texts or loaded).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np



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


def texts_digest(texts: Iterable[str], **options) -> str:
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
        digest = texts_digest(texts, vocab_size=vocab_size, model="bpe", v=1)
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
