"""Token shards (loco_jax.training.data.shard_format, shard_reader, shard_writer, prepare) and prepare_data.py, on tiny corpora: bytes or a 300-piece SentencePiece
model."""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from loco_jax.training.run import config as config_lib
from loco_jax.training.data import batches
from loco_jax.training.data import corpus as corpus_lib
from loco_jax.training.data import prepare
from loco_jax.training.data import shard_format
from loco_jax.training.data import shard_reader
from loco_jax.training.data import shard_writer
from loco_jax.training.data import tokenizers
from loco_jax.training.data import tokens
from loco_jax.training.run import dataset as dataset_lib
from loco_jax.training.data.corpus import file_sha256
from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.data.tokens import encode_works

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = ["thou", "art", "the", "king", "of", "Denmark", "lord", "sweet", "night", "good", "my", "and", "Ünïcödé"]


def _text(rng, lines, indent_every=7):
    """Lines of words with indented lines and blank lines (what piece cuts must get right)."""
    out = []
    for i in range(lines):
        line = " ".join(rng.choice(WORDS, size=rng.randint(1, 12)))
        if i % indent_every == 0:
            line = "    " + line
        out.append(line + ("\n\n" if i % 11 == 0 else "\n"))
    return "".join(out)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """15 .txt files (one long enough to be cut into pieces, one blank) and a .jsonl file."""
    root = tmp_path_factory.mktemp("corpus")
    rng = np.random.RandomState(0)
    texts = {f"work{i:02d}": _text(rng, 900 if i == 3 else 40) for i in range(15)}
    for name, text in texts.items():
        (root / "txt" / f"{name}.txt").parent.mkdir(exist_ok=True)
        (root / "txt" / f"{name}.txt").write_text(text)
    (root / "txt" / "blank.txt").write_text(" \n\n")  # skipped, as data.text_corpus skips it
    records = [{"body": _text(rng, 5), "id": i} for i in range(6)]
    lines = [json.dumps(r) for r in records]
    lines.insert(2, "")  # blank lines are skipped
    (root / "more.jsonl").write_text("\n".join(lines) + "\n")
    assert len(texts["work03"]) > 3 * shard_format.PIECE_CHARS
    return root, texts, [r["body"] for r in records]


def _docs(corpus):
    """The documents of ``--input txt/ more.jsonl`` in order: the .txt files by name, then the records."""
    root, texts, bodies = corpus
    return [texts[k] for k in sorted(texts)] + bodies


def _direct(tok, docs, eval_every):
    """Tokenizing directly: each document encoded whole, joined by the separator, as tokens.load_data does."""
    train = [d for i, d in enumerate(docs) if (i + 1) % eval_every]
    held = [d for i, d in enumerate(docs) if (i + 1) % eval_every == 0]
    return encode_works(tok, train), encode_works(tok, held)


def _quiet(*_, **__):
    pass


# --------------------------------------------------------------------------------------------------------------------
# text -> shards -> the same tokens
# --------------------------------------------------------------------------------------------------------------------


def test_byte_round_trip_matches_direct_tokenization_and_load_data(corpus, tmp_path):
    root, texts, _ = corpus
    out = tmp_path / "byte"
    m = prepare.prepare([root / "txt", root / "more.jsonl"], out, tokenizer="byte", shard_tokens=4096, eval_every=4,
                       text_field="body", log=_quiet)
    assert m["dtype"] == "uint16" and m["tokenizer"] == {"kind": "byte", "vocab_size": 256, "sha256": None,
                                                          "model_file": None}
    train_shards = [s for s in m["shards"] if s["split"] == "train"]
    assert len(train_shards) > 3 and all(s["tokens"] == 4096 for s in train_shards[:-1])  # full but the last
    assert 0 < train_shards[-1]["tokens"] <= 4096
    s = shard_reader.open_shards(out, tokenizer="byte")
    train, held = _direct(tokenizers.ByteTokenizer(), _docs(corpus), 4)
    np.testing.assert_array_equal(np.asarray(s.train), train)
    np.testing.assert_array_equal(np.asarray(s.eval), held)
    assert m["documents"] == {"train": 16, "eval": 5}
    assert shard_reader.verify_shards(out) == m

    # The .txt directory alone, every 14th work held out: exactly tokens.load_data's streams of that directory.
    m14 = prepare.prepare([root / "txt"], tmp_path / "b14", tokenizer="byte", eval_every=14, log=_quiet)
    td = tokens.load_data(root / "txt")
    assert td.corpus.eval_names == ("work13",)
    s14 = tokens.load_data(tmp_path / "b14")  # through data.path, as a run loads it
    assert s14.shards is not None and s14.vocab_size == 256 and m14["eval"] == {"shards": ["eval-00000.u16.bin"]}
    np.testing.assert_array_equal(np.asarray(s14.train_tokens), td.train_tokens)
    np.testing.assert_array_equal(np.asarray(s14.eval_tokens), td.eval_tokens)
    # Shards know their tokenizer, so samples of a shard run read as text (not token ids).
    assert s14.tokenizer.name == "byte" and s14.tokenizer.decode(np.asarray(s14.eval_tokens)) == td.corpus.eval_text


def test_sentencepiece_round_trip_with_pieces(corpus, tmp_path):
    pytest.importorskip("sentencepiece")
    root, _, _ = corpus
    out = tmp_path / "sp"
    m = prepare.prepare([root / "txt", root / "more.jsonl"], out, tokenizer="sentencepiece", vocab_size=300,
                       sample_chars=40_000, shard_tokens=2048, eval_every=4, text_field="body", log=_quiet)
    tok = tokenizers.SentencePieceTokenizer.load(out / "tokenizer.model")
    assert tok.vocab_size == 300 and m["tokenizer"]["vocab_size"] == 300
    assert m["tokenizer"]["sha256"] == file_sha256(out / "tokenizer.model")
    assert m["source"]["piece_chars"] == shard_format.PIECE_CHARS  # the long work was encoded in pieces ...
    s = shard_reader.open_shards(out, tokenizer="sentencepiece", vocab_size=300, sp_model=out / "tokenizer.model")
    train, held = _direct(tok, _docs(corpus), 4)
    np.testing.assert_array_equal(np.asarray(s.train), train)  # ... and gives the tokens of encoding it whole
    np.testing.assert_array_equal(np.asarray(s.eval), held)
    assert tok.decode(np.asarray(s.eval)[: len(tok.encode(_docs(corpus)[3]))]) == _docs(corpus)[3]
    # An existing model (--sp-model): the same tokens, the same hash; a vocabulary asked for must be its own.
    again = prepare.prepare([root / "txt", root / "more.jsonl"], tmp_path / "sp2", tokenizer="sentencepiece",
                           sp_model=out / "tokenizer.model", eval_every=4, text_field="body", log=_quiet)
    assert again["tokenizer"] == m["tokenizer"]
    np.testing.assert_array_equal(np.asarray(shard_reader.open_shards(tmp_path / "sp2").train), train)
    with pytest.raises(ValueError, match="has a vocabulary of 300, not the 512 asked for"):
        prepare.prepare([root / "txt"], tmp_path / "sp3", tokenizer="sentencepiece", sp_model=out / "tokenizer.model",
                       vocab_size=512, log=_quiet)


def test_pieces_are_exact_only_for_tokenizers_that_split_at_newlines():
    text = _text(np.random.RandomState(1), 300)
    assert prepare.pieces_are_exact(tokenizers.ByteTokenizer(), [text])

    class MergesAcrossNewlines(tokenizers.ByteTokenizer):
        def encode(self, t):  # one token for "\n" followed by "t": encoding after a cut differs
            ids = super().encode(t).tolist()
            out, i = [], 0
            while i < len(ids):
                if ids[i] == 10 and i + 1 < len(ids) and ids[i + 1] == ord("t"):
                    out.append(300)
                    i += 2
                else:
                    out.append(ids[i])
                    i += 1
            return np.asarray(out, np.uint16)

    assert not prepare.pieces_are_exact(MergesAcrossNewlines(), ["\n".join(["thou art"] * 400)])


def test_jsonl_field_and_gzip_inputs(tmp_path):
    docs = ["first document\nwith two lines\n", "second", "  third, indented\n"]
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"content": d}) for d in docs[:2]) + "\n")
    (tmp_path / "b.txt").write_text(docs[2])
    m = prepare.prepare([tmp_path / "a.jsonl.gz", tmp_path / "b.txt"], tmp_path / "out", tokenizer="byte",
                       text_field="content", eval_every=100, eval_tail=0.2, log=_quiet)
    joined = corpus_lib.WORK_SEPARATOR.join(docs)
    s = shard_reader.open_shards(tmp_path / "out")
    assert "tail_tokens" in m["eval"]  # fewer documents than eval_every: a held-out tail
    assert tokenizers.ByteTokenizer().decode(np.concatenate([np.asarray(s.train), np.asarray(s.eval)])) == joined
    assert len(s.eval) == m["eval"]["tail_tokens"] == round(len(joined) * 0.2)
    (tmp_path / "bad.jsonl").write_text('{"content": "ok"}\n{"text": "no content field"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 has no 'content' field .*--text-field"):
        prepare.prepare([tmp_path / "bad.jsonl"], tmp_path / "x", tokenizer="byte", text_field="content", log=_quiet)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2 is not valid JSON"):
        prepare.prepare([tmp_path / "broken.jsonl"], tmp_path / "x", tokenizer="byte", log=_quiet)
    assert not (tmp_path / "x").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".x.")], "no temporary directory may be left"


def test_existing_output_is_replaced_only_with_overwrite(tmp_path):
    (tmp_path / "t.txt").write_text("a line of text\n" * 50)
    out = tmp_path / "out"
    prepare.prepare([tmp_path / "t.txt"], out, tokenizer="byte", log=_quiet)
    first = (out / "manifest.json").read_text()
    with pytest.raises(FileExistsError, match="already exists; pass --overwrite"):
        prepare.prepare([tmp_path / "t.txt"], out, tokenizer="byte", log=_quiet)
    (tmp_path / "t.txt").write_text("another text\n" * 80)
    prepare.prepare([tmp_path / "t.txt"], out, tokenizer="byte", overwrite=True, log=_quiet)
    assert (out / "manifest.json").read_text() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "t.txt"]  # no temporary or old directory left


# --------------------------------------------------------------------------------------------------------------------
# Reading: batches, indexing, resume
# --------------------------------------------------------------------------------------------------------------------

TOKENS = np.random.RandomState(0).randint(0, 50_000, size=30_011).astype(np.uint16)
HELD = np.random.RandomState(1).randint(0, 50_000, size=3_001).astype(np.uint16)
SEQ = 64


@pytest.fixture(scope="module")
def token_shards(tmp_path_factory):
    """TOKENS in shards of 1024 tokens (windows of 65 cross shard boundaries), HELD as the eval shards,
    and the same streams as two single token files."""
    root = tmp_path_factory.mktemp("tokens")
    shard_writer.write_token_shards(root / "shards", TOKENS, HELD, vocab_size=50_000, shard_tokens=1024)
    TOKENS.tofile(root / "train.u16.bin")
    HELD.tofile(root / "eval.u16.bin")
    return root


def test_sharded_tokens_index_like_the_array(token_shards):
    s = shard_reader.open_shards(token_shards / "shards")
    t = s.train
    assert len(t) == len(TOKENS) and t.shape == TOKENS.shape and t.dtype == np.uint16 and len(t.files) == 30
    np.testing.assert_array_equal(np.asarray(t), TOKENS)
    np.testing.assert_array_equal(np.asarray(s.eval), HELD)
    for sl in (slice(0, 10), slice(1000, 3100), slice(-5, None), slice(30_000, 40_000), slice(5, 2)):
        np.testing.assert_array_equal(t[sl], TOKENS[sl])
    assert t[1023] == TOKENS[1023] and t[1024] == TOKENS[1024] and t[-1] == TOKENS[-1]
    idx = np.random.RandomState(2).randint(0, len(TOKENS), size=(7, 33))
    np.testing.assert_array_equal(t[idx], TOKENS[idx])
    starts = np.array([0, 1000, 1020, 2047, len(TOKENS) - SEQ - 1])  # 1000 and 1020 cross a boundary
    np.testing.assert_array_equal(t.windows(starts, SEQ + 1), TOKENS[starts[:, None] + np.arange(SEQ + 1)])
    np.testing.assert_array_equal(t.windows([5, 100], 3000, announce=False), [TOKENS[5:3005], TOKENS[100:3100]])
    t.prefetch(np.concatenate([starts, [0, len(TOKENS) - 1]]), 5000)  # across 5 shards, clipped at the end
    v = t.view(1000, 5000)
    np.testing.assert_array_equal(v[10:3000], TOKENS[1010:4000])
    with pytest.raises(IndexError):
        t[len(TOKENS)]
    with pytest.raises(IndexError):
        t.windows([len(TOKENS) - SEQ], SEQ + 1)


def test_batches_over_shards_equal_batches_over_one_token_file(token_shards):
    sharded = tokens.load_data(token_shards / "shards", vocab_size=50_000)
    single = tokens.load_data(token_shards / "train.u16.bin", vocab_size=50_000,
                            eval_path=token_shards / "eval.u16.bin")
    assert isinstance(sharded.train_tokens, shard_reader.ShardedTokens) and isinstance(single.train_tokens, np.ndarray)
    a = batches.Batcher(sharded.train_tokens, seq_len=SEQ, seed=3)
    b = batches.Batcher(single.train_tokens, seq_len=SEQ, seed=3)
    crossing = 0
    for step in range(12):  # past one epoch (468 windows): a new permutation and offset
        for p in range(2):  # what each of two processes reads
            xa, ya = batches.Batcher(sharded.train_tokens, seq_len=SEQ, seed=3, next_sample=a.next_sample).next_batch(
                48, process_index=p, num_processes=2)
            xb, yb = batches.Batcher(single.train_tokens, seq_len=SEQ, seed=3, next_sample=b.next_sample).next_batch(
                48, process_index=p, num_processes=2)
            np.testing.assert_array_equal(xa, xb)
            np.testing.assert_array_equal(ya, yb)
        starts = batches.sample_starts(len(TOKENS), np.arange(a.next_sample, a.next_sample + 48), seq_len=SEQ, seed=3)
        crossing += int(((starts // 1024) != ((starts + SEQ) // 1024)).sum())
        xa, _ = a.next_batch(48)
        xb, _ = b.next_batch(48)
        assert xa.dtype == np.int32
        np.testing.assert_array_equal(xa, xb)
    assert crossing > 0, "some windows must cross shard boundaries"
    assert a.epoch > 1
    ea, eb = (batches.eval_windows(t.eval_tokens, seq_len=SEQ, max_windows=20) for t in (sharded, single))
    np.testing.assert_array_equal(ea[0], eb[0])
    np.testing.assert_array_equal(ea[1], eb[1])


def test_resume_position_and_refuse_changed_shards(token_shards, tmp_path):
    first = batches.Batcher(shard_reader.open_shards(token_shards / "shards").train, seq_len=SEQ, seed=5)
    straight = [first.next_batch(32)[0] for _ in range(6)]
    restart = batches.Batcher(shard_reader.open_shards(token_shards / "shards").train, seq_len=SEQ, seed=5)
    for _ in range(2):
        restart.next_batch(32)
    state = json.loads(json.dumps(restart.state()))  # as a checkpoint stores it
    assert state["next_sample"] == 64 and state["num_tokens"] == len(TOKENS) and state["fingerprint"]
    resumed = batches.Batcher(shard_reader.open_shards(token_shards / "shards").train, seq_len=SEQ, seed=5).restore(state)
    for k in range(2, 6):
        np.testing.assert_array_equal(resumed.next_batch(32)[0], straight[k])
    other = TOKENS.copy()
    other[100] += 1  # the same length, another content
    shard_writer.write_token_shards(tmp_path / "other", other, HELD, vocab_size=50_000, shard_tokens=1024)
    with pytest.raises(ValueError, match="fingerprint .* the shard files changed"):
        batches.Batcher(shard_reader.open_shards(tmp_path / "other").train, seq_len=SEQ, seed=5).restore(state)


def test_tail_eval_and_uint32_shards(tmp_path):
    big = np.random.RandomState(3).randint(0, 100_000, size=10_000).astype(np.uint32)
    m = shard_writer.write_token_shards(tmp_path, big, vocab_size=100_000, shard_tokens=3000, eval_tail=0.1)
    assert m["dtype"] == "uint32" and m["shards"][0]["file"] == "train-00000.u32.bin"
    assert m["eval"] == {"tail_tokens": 1000}
    s = shard_reader.open_shards(tmp_path)
    np.testing.assert_array_equal(np.asarray(s.train), big[:9000])
    np.testing.assert_array_equal(np.asarray(s.eval), big[9000:])
    # one shard is a token file of its own
    np.testing.assert_array_equal(tokens.load_tokens(tmp_path / "train-00001.u32.bin"), big[3000:6000])


# --------------------------------------------------------------------------------------------------------------------
# A run's Dataset: the config's tokenizer, the pod recipe's refusal, bad input before anything compiles
# --------------------------------------------------------------------------------------------------------------------


def _config(path=None, **overrides):
    cfg = config_lib.Config(steps=2, batch_size=8, seq_len=16, eval_every=2, eval_batches=1, log_every=1,
                            checkpoint_every=2)
    m = cfg.model
    m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_seq_len, m.compute_dtype = 16, 1, 2, 32, 16, "float32"
    cfg.data.path = None if path is None else str(path)
    return config_lib.override(cfg, [f"{k}={v}" for k, v in overrides.items()])


def test_dataset_trains_on_shards_and_checks_the_tokenizer(corpus, tmp_path):
    pytest.importorskip("sentencepiece")
    root, _, _ = corpus
    out = tmp_path / "sp"
    prepare.prepare([root / "txt"], out, tokenizer="sentencepiece", vocab_size=300, sample_chars=30_000,
                   shard_tokens=2048, eval_every=5, log=_quiet)
    model = str(out / "tokenizer.model")
    logs = []
    ds = dataset_lib.Dataset(_config(out, **{"data.tokenizer": "sentencepiece", "data.sp_vocab_size": "300",
                                             "data.sp_model": model, "model.vocab_size": "300"}), log=logs.append)
    assert "sha256" in logs[0] and "tokenizer sentencepiece (vocabulary 300" in logs[0]
    x, y = ds.train_iterator(seed=0).next_batch(8)
    direct = batches.Batcher(shard_reader.open_shards(out).train, seq_len=16, seed=0).next_batch(8)
    np.testing.assert_array_equal(x, direct[0])
    assert x.max() < 300
    assert len(list(ds.eval_batches(8, 1))) == 1
    # The tokenizer saved beside the shards decodes them (data.sp_model given, or found there by itself).
    tok = tokenizers.SentencePieceTokenizer.load(model)
    assert ds.tokens.tokenizer.proto == tok.proto
    assert tokens.load_data(out, tokenizer="sentencepiece").tokenizer.proto == tok.proto
    (tmp_path / "bare").mkdir()  # the model file gone: training still loads, samples fall back to ids
    for f in out.iterdir():
        if f.name != "tokenizer.model":
            (tmp_path / "bare" / f.name).symlink_to(f)
    assert tokens.load_data(tmp_path / "bare", tokenizer="sentencepiece").tokenizer is None

    # The manifest against the config: tokenizer kind, vocabulary, model hash; each names the fix.
    sp = {"data.tokenizer": "sentencepiece", "model.vocab_size": "1024"}
    with pytest.raises(ValueError, match=r"made with the sentencepiece tokenizer .* data.tokenizer='byte'.*"
                                         r"--set data.tokenizer=sentencepiece --set data.sp_vocab_size=300"):
        dataset_lib.Dataset(_config(out), log=_quiet)
    with pytest.raises(ValueError, match=r"vocabulary of 300 \(sentencepiece\), not data.sp_vocab_size=1024"):
        dataset_lib.Dataset(_config(out, **sp, **{"data.sp_vocab_size": "1024"}), log=_quiet)
    other = tmp_path / "other.model"
    tokenizers.SentencePieceTokenizer.train(["another text entirely, to train another model.\n" * 300], 300, other)
    with pytest.raises(ValueError, match=r"data.sp_model='.*other.model' .* is not the tokenizer the shards"):
        dataset_lib.Dataset(_config(out, **sp, **{"data.sp_vocab_size": "300", "data.sp_model": str(other)}),
                            log=_quiet)
    with pytest.raises(ValueError, match=r"the eval split of .* holds .* tokens, fewer than one window of seq_len \+ 1 "
                                         r"= 4097.*--eval-every"):
        dataset_lib.Dataset(_config(out, **{"data.tokenizer": "sentencepiece", "data.sp_vocab_size": "300",
                                            "data.sp_model": model, "model.vocab_size": "300", "seq_len": "4096",
                                            "model.max_seq_len": "4096"}), log=_quiet)
    with pytest.raises(ValueError, match="uses 300 token ids but model.vocab_size=256"):
        dataset_lib.Dataset(_config(out, **{"data.tokenizer": "sentencepiece", "data.sp_vocab_size": "300"}),
                            log=_quiet)
    byte = tmp_path / "byte"
    prepare.prepare([root / "txt"], byte, tokenizer="byte", log=_quiet)
    with pytest.raises(ValueError, match=r"made with the byte tokenizer .* data.tokenizer='sentencepiece'"):
        dataset_lib.Dataset(_config(byte, **sp, **{"data.sp_vocab_size": "300"}), log=_quiet)
    with pytest.raises(ValueError, match="data.tokenizer='byte'; set data.tokenizer=sentencepiece"):
        config_lib.validate(_config(byte, **{"data.sp_model": model}))


def test_pod_recipe_refuses_to_start_without_data_path(tmp_path):
    cfg = config_lib.load(str(ROOT / "configs" / "diloco_1b.py"))  # validate passes: compile-only tools work
    assert cfg.data.require_path is True and cfg.data.path is None
    with pytest.raises(ValueError) as err:
        dataset_lib.Dataset(cfg, log=_quiet)
    msg = str(err.value)
    assert "python prepare_data.py --input" in msg and "--tokenizer sentencepiece --vocab-size 32000" in msg
    assert "--set data.path=/data/shards --set data.sp_model=/data/shards/tokenizer.model" in msg
    # A tiny config with the same flag, through the trainer: refused before anything compiles or is written.
    workdir = tmp_path / "run"
    with pytest.raises(ValueError, match=r"(?s)data.require_path=True.*prepare_data.py --input .* --tokenizer byte"):
        train_and_evaluate(_config(None, **{"data.require_path": "true"}), str(workdir), log=_quiet)
    assert not any(workdir.iterdir())
    assert config_lib.Config().data.require_path is None  # other configs load Shakespeare as before


def _bad_dirs(token_shards, tmp_path):
    """(path, exception, message) for each kind of bad shard directory."""
    def copy(name):
        dst = tmp_path / name
        dst.mkdir()
        for f in (token_shards / "shards").iterdir():
            (dst / f.name).write_bytes(f.read_bytes())
        return dst

    empty = tmp_path / "empty"
    empty.mkdir()
    no_manifest = copy("no_manifest")
    (no_manifest / "manifest.json").unlink()
    missing = copy("missing")
    (missing / "train-00007.u16.bin").unlink()
    truncated = copy("truncated")
    f = truncated / "train-00003.u16.bin"
    f.write_bytes(f.read_bytes()[:-6])
    longer = copy("longer")
    (longer / "eval-00000.u16.bin").write_bytes((longer / "eval-00000.u16.bin").read_bytes() + b"\0\0")
    broken = copy("broken")
    (broken / "manifest.json").write_text((broken / "manifest.json").read_text()[:-40])
    sums = copy("sums")
    m = json.loads((sums / "manifest.json").read_text())
    m["total_tokens"] += 1
    (sums / "manifest.json").write_text(json.dumps(m))
    newer = copy("newer")
    m = json.loads((newer / "manifest.json").read_text())
    m["version"] = shard_format.VERSION + 1
    (newer / "manifest.json").write_text(json.dumps(m))
    return [
        (empty, ValueError, r"holds no .txt files and no manifest.json .*prepare_data.py --input"),
        (no_manifest, ValueError, r"no_manifest holds no manifest.json, so it holds no token shards .*prepare_data.py"),
        (missing, FileNotFoundError, r"shard .*missing/train-00007.u16.bin listed in .* does not exist"),
        (truncated, ValueError, r"train-00003.u16.bin has 2,042 bytes, but .* says 1,024 tokens x 2 bytes "
                                r"\(uint16\) = 2,048: it is truncated"),
        (longer, ValueError, r"eval-00000.u16.bin has .* corrupt \(too long\)"),
        (broken, ValueError, r"broken/manifest.json is not valid JSON .*prepare_data.py"),
        (sums, ValueError, r"'total_tokens' is 33013 but the shards hold 33012"),
        (newer, ValueError, r"format version 2; this loco-jax reads versions up to 1"),
    ]


def test_bad_shard_directories_fail_early_naming_the_file(token_shards, tmp_path):
    cases = _bad_dirs(token_shards, tmp_path)
    for path, error, match in cases:
        with pytest.raises(error, match=match):
            tokens.load_data(path, vocab_size=50_000)
    # Through the trainer: refused before anything compiles, nothing written (two representative cases).
    for path, error, match in (cases[2], cases[3]):
        workdir = tmp_path / f"run-{path.name}"
        with pytest.raises(error, match=match):
            train_and_evaluate(_config(path, **{"model.vocab_size": "50000"}), str(workdir), log=_quiet)
        assert not any(workdir.iterdir())
    # verify_shards catches what sizes cannot: a changed byte.
    flipped = tmp_path / "flipped"
    shard_writer.write_token_shards(flipped, TOKENS, HELD, vocab_size=50_000, shard_tokens=1024)
    raw = bytearray((flipped / "train-00002.u16.bin").read_bytes())
    raw[10] ^= 1
    (flipped / "train-00002.u16.bin").write_bytes(bytes(raw))
    shard_reader.open_shards(flipped)  # the size is right
    with pytest.raises(ValueError, match="train-00002.u16.bin has SHA-256 .* its contents changed"):
        shard_reader.verify_shards(flipped)


# --------------------------------------------------------------------------------------------------------------------
# Progress and the command
# --------------------------------------------------------------------------------------------------------------------


class _Stream:
    def __init__(self, tty):
        self.tty, self.text = tty, ""

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text += s

    def flush(self):
        pass


def test_progress_updates_one_line_on_a_tty_and_logs_lines_elsewhere():
    tty = _Stream(True)
    p = prepare.TextProgress(tty, every_s=0.0)
    for done in (10, 50, 100):
        p("tokenizing", done * 2**20 // 100, 2**20, tokens=done * 1000, shards=1, final=done == 100)
    assert tty.text.count("\r") == 3 and tty.text.endswith("\n") and "[########################]" in tty.text
    assert "100.0%" in tty.text and "100,000 tokens" in tty.text
    log = _Stream(False)
    p = prepare.TextProgress(log, every_s=3600)
    for done in range(1, 101):
        p("tokenizing", done, 100, tokens=done, final=done == 100)
    lines = log.text.splitlines()
    assert "\r" not in log.text and len(lines) == 1 and lines[0].startswith("tokenizing: 100.0%")


def test_prepare_data_command_end_to_end(corpus, tmp_path):
    pytest.importorskip("sentencepiece")
    root, _, _ = corpus
    out = tmp_path / "shards"
    cmd = [sys.executable, str(ROOT / "prepare_data.py"), "--input", str(root / "txt"), str(root / "more.jsonl"),
           "--output", str(out), "--vocab-size", "300", "--sample-chars", "40000", "--shard-tokens", "2048",
           "--eval-every", "4", "--text-field", "body", "--verify"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "tokenizing: 100.0%" in proc.stderr  # the progress (plain lines: stderr is not a terminal)
    assert f"--set data.path={out} --set data.tokenizer=sentencepiece --set data.sp_vocab_size=300" in proc.stdout
    m = shard_format.read_manifest(out)
    assert m["source"]["command"].startswith("python prepare_data.py --input ")
    tok = tokenizers.SentencePieceTokenizer.load(out / "tokenizer.model")
    train, held = _direct(tok, _docs(corpus), 4)
    s = shard_reader.open_shards(out, tokenizer="sentencepiece", vocab_size=300, sp_model=out / "tokenizer.model")
    np.testing.assert_array_equal(np.asarray(s.train), train)
    np.testing.assert_array_equal(np.asarray(s.eval), held)
    # Errors: exit status 1 and a one-line message, nothing written.
    proc = subprocess.run(cmd[:-1], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 1 and "already exists; pass --overwrite" in proc.stderr
    from prepare_data import main  # in-process: argparse's own checks

    with pytest.raises(SystemExit):
        main(["--input", str(root / "txt"), "--output", str(tmp_path / "x")])  # sentencepiece without a vocabulary
    assert main(["--input", str(tmp_path / "nowhere"), "--output", str(tmp_path / "x"), "--tokenizer", "byte"]) == 1
    assert not (tmp_path / "x").exists()
