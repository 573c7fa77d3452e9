"""``prepare_data.py``'s pipeline: text files in, token shards out (:func:`prepare`), with its inputs,
document pieces, encoder and progress line.

Documents and tokenization
==========================
Inputs are ``.txt`` files (one document each) and ``.jsonl`` files (one document per line, the text in a
configurable field), optionally gzipped; a directory contributes its ``*.txt``/``*.jsonl``(``.gz``)
files, recursively, sorted by path. Whitespace-only documents are skipped. Document ``i`` (0-based over
the non-empty documents of all inputs, in order) is held out for evaluation when ``(i + 1) % eval_every
== 0``; when that holds out nothing (fewer than ``eval_every`` documents), the last ``eval_tail`` of the
token stream is held out instead. Within a split, documents are joined by the tokens of
``corpus.WORK_SEPARATOR`` (a blank line), as :func:`~loco_jax.training.data.tokens.load_data` joins works, so the
shards of a corpus hold the tokens that tokenizing each document directly and joining them gives.

A long document is encoded in pieces of about ``piece_chars`` characters, cut after a newline that is
followed by a non-space character; a piece after the first is encoded behind a newline whose tokens
are then dropped. Pieces bound the memory of a large ``.txt`` file and are several times faster for
SentencePiece (its encoding time grows faster than linearly with the input's length), and they give the
same tokens as encoding the whole document: exactly for the byte tokenizer and the SentencePiece models
this project trains (the newline is a user-defined symbol, so no token crosses it), and, for any other
model, :func:`pieces_are_exact` checks it on a sample first and documents are encoded whole otherwise.

Why one module of this size: ``prepare`` reads, encodes and writes in one pass over the inputs, and
its pieces (inputs, document pieces, the encoder, the progress line) exist only for it.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from loco_jax.training.data.corpus import WORK_SEPARATOR, decode_text
from loco_jax.training.data.shard_format import (
    DEFAULT_EVAL_EVERY, DEFAULT_EVAL_TAIL, DEFAULT_SAMPLE_CHARS, DEFAULT_SHARD_TOKENS, PIECE_CHARS, SPLITS,
    TOKENIZER_FILE, READ_BLOCK, token_dtype, write_manifest,
)
from loco_jax.training.data.shard_writer import ShardWriter, build_manifest, tail_tokens, tokenizer_entry
from loco_jax.training.data.tokenizers import ByteTokenizer, SentencePieceTokenizer
from loco_jax.training.progress import ProgressLine, hms

_BATCH_CHARS = 1 << 21  # characters encoded per call (SentencePiece spreads a call over its threads)
_TEXT_SUFFIXES = (".txt", ".txt.gz")
_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


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
    raw = io.BufferedReader(_Counting(open(path, "rb", buffering=0), on_bytes), buffer_size=READ_BLOCK)
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
    :func:`loco_jax.training.data.tokens.load_data` decodes a file (UTF-8, else Latin-1; newlines normalized).
    Nothing for a whitespace-only file."""
    buf, rest, seen = "", b"", False
    with _open(path, on_bytes) as f:
        while True:
            block = f.read(READ_BLOCK)
            if block:
                raw = rest + block
                cut = raw.rfind(b"\n") + 1
                if cut == 0:
                    rest = raw
                    continue
                text, rest = decode_text(raw[:cut]), raw[cut:]
            else:
                text, rest = (decode_text(rest) if rest else ""), b""
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
    """Progress of :func:`prepare` on a :class:`~loco_jax.training.progress.ProgressLine`: per phase, the
    share of its input bytes, MiB/s, tokens and shards, and the time left; on a terminal every 0.2 s,
    elsewhere a line every 30 s (``every_s``)."""

    def __init__(self, stream=None, *, every_s: float | None = None):
        self.line = ProgressLine(stream)
        self.line.every_s = every_s if every_s is not None else (0.2 if self.line.tty else 30.0)
        self._t0, self._phase = time.perf_counter(), None

    def __call__(self, phase: str, done: int, total: int, tokens: int = 0, shards: int = 0, final: bool = False):
        now = time.perf_counter()
        if phase != self._phase:
            self.line.restart(wait=True)  # a phase's first line comes after every_s, as its later ones
            self._phase, self._t0 = phase, now
        dt = max(now - self._t0, 1e-9)
        frac = min(1.0, done / total) if total else 0.0
        eta = (dt / frac - dt) if 0 < frac < 1 else 0.0
        text = (f"{phase}: {frac:6.1%} {done / 2**20:,.1f}/{total / 2**20:,.1f} MiB, {done / 2**20 / dt:,.2f} MiB/s"
                + (f", {tokens:,} tokens ({tokens / dt:,.0f}/s), {shards} shard(s)" if tokens else "")
                + (f", {hms(eta)} left" if eta else f", {hms(dt)}"))
        self.line.show(frac, text, final=final)

    def close(self):
        self.line.close()


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


def _check_prepare_args(tokenizer, vocab_size, sp_model, eval_every, eval_tail, shard_tokens) -> str:
    """The tokenizer kind (``"byte"`` or ``"sentencepiece"``) once every argument of :func:`prepare` that
    needs no file is checked; raises naming the bad value."""
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
    return kind


def _check_output(files, out: Path, overwrite: bool):
    """Refuses an output that exists (unless ``overwrite``, or an empty directory), is a file, or holds an input."""
    if out.exists() and not overwrite and not (out.is_dir() and not any(out.iterdir())):
        raise FileExistsError(f"output {out} already exists; pass --overwrite to replace it, or choose another "
                              "--output.")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {out} is a file, not a directory; choose another --output.")
    for f in files:
        if out.resolve() in f.resolve().parents:
            raise ValueError(f"input {f} lies inside the output directory {out}; choose an --output outside the input.")


def _describe(files) -> str:
    return f"the inputs ({', '.join(map(str, files[:3]))}{', ...' if len(files) > 3 else ''})"


def _tokenizer(kind, files, *, vocab_size, sp_model, sample_chars, text_field, eval_every, total_bytes, on_bytes,
               log):
    """``(tokenizer, model proto or None, sample)``: bytes, a SentencePiece model loaded from ``sp_model``, or
    one trained on ``sample_chars`` characters of the training documents (``sample``: the texts it saw)."""
    if kind == "byte":
        return ByteTokenizer(), None, []
    if sp_model is not None:
        tok = SentencePieceTokenizer.load(Path(sp_model).expanduser())
        if vocab_size and vocab_size != tok.vocab_size:
            raise ValueError(f"SentencePiece model {sp_model} has a vocabulary of {tok.vocab_size}, not the "
                             f"{vocab_size} asked for; drop --vocab-size or pass --vocab-size {tok.vocab_size}.")
        return tok, tok.proto, []
    sample = _sample(files, text_field, eval_every, sample_chars, total_bytes, on_bytes)
    if not sample:
        raise ValueError(f"{_describe(files)} hold no training text to train a tokenizer on.")
    t0 = time.perf_counter()
    chars = sum(map(len, sample))
    log(f"training a {vocab_size}-piece SentencePiece BPE model on {chars:,} characters ({len(sample):,} pieces) ...")
    try:
        tok = SentencePieceTokenizer.train(sample, int(vocab_size))
    except RuntimeError as e:  # SentencePiece's own refusal, e.g. a vocabulary too large for the text
        raise ValueError(
            f"SentencePiece could not train a {vocab_size}-piece model on {chars:,} characters "
            f"({str(e).split('] ')[-1]}); pass a smaller --vocab-size or more text (--sample-chars)."
        ) from e
    log(f"trained in {time.perf_counter() - t0:.1f} s")
    return tok, tok.proto, sample


def _encode_and_write(tmp, files, tok, dtype, *, shard_tokens, eval_every, text_field, piece_chars, threads,
                      on_bytes, report):
    """One pass over the inputs: each document's pieces encoded in batches of characters and written to the
    train or eval shards, documents of a split joined by the separator's tokens. Returns ``(train shards,
    eval shards, documents per split, train tokens)``; ``report(tokens, shards)`` after each batch."""
    writers = {s: ShardWriter(tmp, s, dtype, shard_tokens) for s in SPLITS}
    docs = {s: 0 for s in SPLITS}
    sep = np.asarray(tok.encode(WORK_SEPARATOR))
    encode = _Encoder(tok, threads)

    def flush(batch):
        for (doc, first, _), ids in zip(batch, encode([(f, t) for _, f, t in batch])):
            split = "eval" if _is_eval(doc, eval_every) else "train"
            if first:
                if docs[split]:
                    writers[split].write(sep)
                docs[split] += 1
            writers[split].write(ids)
        report(writers["train"].tokens + writers["eval"].tokens, sum(len(w.entries) for w in writers.values()))

    batch, chars = [], 0
    for item in iter_pieces(files, text_field=text_field, piece_chars=piece_chars, on_bytes=on_bytes):
        batch.append(item)
        chars += len(item[2])
        if chars >= _BATCH_CHARS:
            flush(batch)
            batch, chars = [], 0
    if batch:
        flush(batch)
    n_train, n_eval = writers["train"].tokens, writers["eval"].tokens
    train, held = writers["train"].close(), writers["eval"].close()
    report(n_train + n_eval, len(train) + len(held))
    return train, held, docs, n_train


def _move_into_place(tmp: Path, out: Path):
    """``tmp`` renamed to ``out`` (an existing ``out`` moved aside first and removed after)."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def _count_bytes(done, progress, phase, total_bytes, n):
    """Adds ``n`` bytes read to ``done[0]`` and reports the phase's progress."""
    done[0] += n
    progress(phase, done[0], total_bytes)


def _exact_piece_chars(tok, sample, files, text_field, piece_chars, log):
    """``piece_chars``, or None (documents encoded whole) where this SentencePiece model does not encode a
    document as the concatenation of its pieces (checked on the sample, or on the first pieces)."""
    check = sample or [t for _, _, t in _take(iter_pieces(files, text_field=text_field, piece_chars=1 << 16), 8)]
    if pieces_are_exact(tok, check):
        return piece_chars
    log("note: this SentencePiece model does not split at newlines; documents are encoded whole")
    return None


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
    kind = _check_prepare_args(tokenizer, vocab_size, sp_model, eval_every, eval_tail, shard_tokens)
    files = find_inputs(inputs)
    out = Path(output).expanduser()
    _check_output(files, out, overwrite)
    total_bytes = sum(f.stat().st_size for f in files)
    progress = progress or (lambda *a, **k: None)
    log(f"{len(files)} input file(s), {total_bytes / 1e6:,.1f} MB -> {out} ({kind} tokenizer)")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        done = [0]  # bytes read in the current phase
        counter = lambda phase: functools.partial(_count_bytes, done, progress, phase, total_bytes)

        tok, proto, sample = _tokenizer(kind, files, vocab_size=vocab_size, sp_model=sp_model,
                                        sample_chars=sample_chars, text_field=text_field, eval_every=eval_every,
                                        total_bytes=total_bytes, on_bytes=counter("sampling"), log=log)
        if sample:
            progress("sampling", done[0], total_bytes, final=True)
        if proto is not None:
            (tmp / TOKENIZER_FILE).write_bytes(proto)
        vocab = int(tok.vocab_size)
        dtype = token_dtype(vocab)
        if kind == "sentencepiece" and piece_chars is not None:
            piece_chars = _exact_piece_chars(tok, sample, files, text_field, piece_chars, log)

        t_encode = time.perf_counter()
        done[0] = 0
        train, held, docs, n_train = _encode_and_write(
            tmp, files, tok, dtype, shard_tokens=shard_tokens, eval_every=eval_every, text_field=text_field,
            piece_chars=piece_chars, threads=threads, on_bytes=counter("tokenizing"),
            report=lambda tokens, shards: progress("tokenizing", done[0], total_bytes, tokens, shards))
        progress("tokenizing", total_bytes, total_bytes, n_train + sum(e["tokens"] for e in held),
                 len(train) + len(held), final=True)
        if not train:
            raise ValueError(f"{_describe(files)} hold no text (every document is empty or held out).")
        tail = 0 if held else tail_tokens(n_train, eval_tail)
        seconds = time.perf_counter() - t_encode
        source = _source(files, total_bytes, sample, seconds, command, text_field=text_field, eval_every=eval_every,
                         eval_tail=eval_tail, shard_tokens=shard_tokens, piece_chars=piece_chars)
        manifest = build_manifest(dtype, tokenizer_entry(kind, vocab, proto), train, held, tail,
                                  {"train": docs["train"], "eval": docs["eval"]}, source)
        write_manifest(tmp, manifest)
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = manifest["total_tokens"]
    log(f"wrote {len(manifest['shards'])} shard(s) to {out}: {total:,} tokens ({n_train - tail:,} train, "
        f"{total - n_train + tail:,} eval; {docs['train']:,} + {docs['eval']:,} documents), {dtype}, "
        f"{kind} vocabulary {vocab}; {total / max(seconds, 1e-9):,.0f} tokens/s, "
        f"{time.perf_counter() - t_start:.1f} s in all")
    return manifest


def _source(files, total_bytes, sample, seconds, command, **settings):
    """The manifest's ``source`` entry: what was read, with which settings, by which command, how fast."""
    return {"inputs": [str(f) for f in files], "input_bytes": total_bytes, "text_field": settings["text_field"],
            "eval_every": settings["eval_every"], "eval_tail": settings["eval_tail"],
            "shard_tokens": settings["shard_tokens"], "piece_chars": settings["piece_chars"],
            "sample_chars": sum(map(len, sample)) if sample else None, "command": command,
            "seconds": round(seconds, 3)}


def _take(it, n):
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


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
