"""Bad settings fail before anything compiles, with a message naming the value and what is allowed."""

import os

import jax
import numpy as np
import pytest

from loco_jax.training.run import config as config_lib
from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.run.trainer import Trainer
from tests.helpers import quiet, small_config


def _token_file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


CASES = [
    # (overrides or a callable(tmp_path) -> overrides, exception, message)
    ({"loco.bits": "3"}, ValueError, "bits=3 is not supported; choose one of"),
    ({"loco.bits": "16"}, ValueError, "bits=16"),
    ({"loco.block_size": "0"}, ValueError, "block_size=0 must be a positive integer"),
    ({"loco.block_size": "100"}, ValueError, "block_size=100 must be a multiple of 8"),
    ({"loco.beta": "1.5"}, ValueError, r"beta=1.5 must lie in \[0, 1\)"),
    ({"loco.error_bits": "5"}, ValueError, "error_bits=5 is not supported"),
    ({"diloco.bits": "3"}, ValueError, "bits=3 is not supported"),
    ({"diloco.format": "e3m0", "diloco.bits": "8"}, ValueError, r"format='e3m0' supports bits in \(4,\), not bits=8"),
    ({"loco.bits": "8", "loco.format": "lloyd"}, ValueError, r"format='lloyd' supports bits in \(1, 2, 4\), not bits=8"),
    ({"loco.bits": "4", "loco.format": "nf4"}, ValueError, "loco.format='nf4' is unknown; choose one of"),
    ({"loco.bits": "4", "loco.rotate": "true", "loco.block_size": "96"}, ValueError,
     "rotate=True needs a power-of-two block_size .* not 96"),
    ({"diloco.bits": "2", "diloco.rotate": "true", "diloco.block_size": "192"}, ValueError,
     "rotate=True needs a power-of-two block_size"),
    ({"loco.bits": "2", "loco.preset": "best"}, ValueError, "loco.preset='best' must be one of"),
    ({"diloco.format": "fp4"}, ValueError, "format='fp4' is unknown"),
    ({"loco.bits": "2", "loco.format": "binmean"}, ValueError, "loco.format='binmean' is unknown"),
    ({"diloco.format": "binmean", "diloco.bits": "2"}, ValueError,
     "diloco.format='binmean' quantizes a sparse exchange's kept values; set diloco.density"),
    ({"diloco.sync_every": "0"}, ValueError, "sync_every=0 must be a positive integer"),
    ({"diloco.sync_every": "2", "diloco.num_fragments": "3", "diloco.overlap": "0"}, ValueError,
     "num_fragments=3 exceeds sync_every=2"),
    ({"diloco.overlap": "2"}, ValueError, r"overlap=2 must be an integer in \[0, floor\(H / P\)\) = \[0, 2\)"),
    ({"diloco.overlap": "-1"}, ValueError, "overlap=-1"),
    ({"diloco.alpha": "1.5"}, ValueError, r"alpha=1.5 must lie in \[0, 1\]"),
    ({"diloco.mode": "ring"}, ValueError, "mode='ring' is unknown"),
    ({"diloco.num_fragments": "5", "diloco.overlap": "0"}, ValueError, "num_fragments=5 puts the 2 transformer blocks into 4 fragments"),
    ({"mesh.replicas": "3"}, ValueError, "mesh.replicas=3 does not divide the 8 devices"),
    # FSDP over 4 devices: a leaf with no dimension divisible by 4 is named with its shape
    ({"mesh.fsdp": "true", "model.d_model": "30", "model.num_heads": "3", "model.d_ff": "90"},
     ValueError, r"FSDP over 4 devices: parameter 'final_norm/scale' of shape \(30,\)"),
    ({"accum_steps": "4"}, ValueError, "accum_steps=4 must divide the 2 sequences each device gets"),
    ({"micro_batch": "0"}, ValueError, "micro_batch=0 must be a positive integer or None"),
    ({"micro_batch": "1", "accum_steps": "2"}, ValueError, "micro_batch=1 derives accum_steps .* set one of them"),
    ({"batch_size": "24", "micro_batch": "2"}, ValueError,
     "micro_batch=2 must divide the 3 sequences each device gets .* choose a divisor of 3"),
    ({"model.attention": "flash"}, ValueError, r"model.attention='flash' must be one of \('auto', 'xla', 'cudnn'\)"),
    ({"model.attention": "cudnn"}, ValueError, "model.attention='cudnn' takes 16-bit inputs, but model.compute_dtype='float32'"),
    ({"mesh.local": "2"}, ValueError, "mesh.local=2 .* is for data parallel"),
    ({"mesh.data": "2"}, ValueError, "needs 4 devices, but 8 are visible"),
    ({"diloco.enabled": "false"}, ValueError, "mesh.replicas=2 needs diloco.enabled=True"),
    ({"batch_size": "12"}, ValueError, "batch_size=12 must be a multiple of the 8 devices"),
    ({"seq_len": "64"}, ValueError, "seq_len=64 exceeds model.max_seq_len=32"),
    ({"steps": "0"}, ValueError, "steps=0 must be a positive integer"),
    ({"nonfinite": "ignore"}, ValueError, "nonfinite='ignore' must be 'skip' or 'stop'"),
    ({"data.tokenizer": "words"}, ValueError, "data.tokenizer='words' must be 'byte' or 'sentencepiece'"),
    (lambda tmp: {"data.path": str(tmp / "missing.txt")}, FileNotFoundError, "missing.txt"),
    (lambda tmp: {"data.path": str((tmp / "empty").mkdir() or (tmp / "empty"))}, ValueError, "empty"),
    (lambda tmp: {"data.path": _token_file(tmp, "tokens.u16.bin", b"\x01\x00\x02")}, ValueError, "multiple of"),
    (lambda tmp: {"data.path": _token_file(tmp, "big.u16.bin", np.array([1, 300], np.uint16).tobytes() * 400)},
     ValueError, "uses 301 token ids but model.vocab_size=256; raise model.vocab_size to at least 301"),
]


@pytest.mark.parametrize("overrides,error,match", CASES, ids=[str(i) for i in range(len(CASES))])
def test_bad_setting_fails_early_and_writes_nothing(text_file, tmp_path, overrides, error, match):  # noqa: F811
    if callable(overrides):
        overrides = overrides(tmp_path)
    workdir = tmp_path / "run"
    with pytest.raises(error, match=match):
        cfg = small_config(text_file, **overrides)
        train_and_evaluate(cfg, str(workdir), log=quiet)
    assert not workdir.exists() or not any(workdir.iterdir()), "nothing may be written for a bad setting"


@pytest.mark.parametrize(
    "assignment,match",
    [
        ("loco.bitz=4", "unknown key 'loco.bitz'. Valid keys:"),
        ("steps=1.5", "steps='1.5': expected an int"),
        ("diloco.alpha=half", "diloco.alpha='half': expected a float"),
        ("diloco.enabled=2", "expected a bool"),
        ("nokey", "expected key=value"),
    ],
)
def test_unknown_keys_and_wrong_types(assignment, match):
    with pytest.raises(ValueError, match=match):
        config_lib.override(config_lib.Config(), [assignment])


def test_changed_optimizer_and_model_shape_on_resume_are_refused(text_file, tmp_path):  # noqa: F811
    workdir = str(tmp_path)
    train_and_evaluate(small_config(text_file, steps=2, checkpoint_every=2, eval_every=2), workdir, log=quiet)
    before = sorted(os.listdir(tmp_path)), open(tmp_path / "config.json").read()
    for overrides, field in (({"optim.lr": "0.1"}, "optim.lr"), ({"model.num_layers": "3"}, "model.num_layers")):
        with pytest.raises(ValueError, match=f"{field}.*cannot change on resume"):
            train_and_evaluate(small_config(text_file, steps=2, checkpoint_every=2, eval_every=2, **overrides),
                                       workdir, log=quiet)
    assert (sorted(os.listdir(tmp_path)), open(tmp_path / "config.json").read()) == before


@pytest.mark.parametrize("micro_batch,accum", [(None, 1), (1, 2), (2, 1), (64, 1)])
def test_micro_batch_derives_the_accumulation_from_the_device_count(text_file, micro_batch, accum):  # noqa: F811
    """2 sequences per device (16 over 8 devices): micro-batches of 1 are 2 of them; 2 or more, one."""
    t = Trainer(small_config(text_file, **({} if micro_batch is None else {"micro_batch": micro_batch})), None,
                        log=quiet)
    assert t.accum_steps == accum


def test_attention_auto_takes_cudnn_only_where_it_applies():
    from loco_jax.training.run.steps import attention_impl

    gpu = lambda cc: type("Device", (), {"platform": "gpu", "compute_capability": cc})()
    assert attention_impl("auto", "bfloat16", 128, gpu("9.0")) == "cudnn"
    assert attention_impl("auto", "float16", 64, gpu("8.0")) == "cudnn"
    assert attention_impl("auto", "bfloat16", 128, gpu("7.0")) is None  # before Ampere: XLA's
    assert attention_impl("auto", "float32", 128, gpu("9.0")) is None  # cuDNN's fused attention is 16-bit only
    assert attention_impl("auto", "bfloat16", 100, gpu("9.0")) is None and attention_impl("auto", "bfloat16", 256, gpu("9.0")) is None
    assert attention_impl("auto", "bfloat16", 128, jax.devices("cpu")[0]) is None and attention_impl("auto", "bfloat16", 128) is None
    assert attention_impl("xla", "bfloat16", 128, gpu("9.0")) is None and attention_impl("cudnn", "bfloat16", 128) == "cudnn"
