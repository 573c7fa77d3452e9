"""Generation (``model.generate``) and the samples block (``training.run.sample``, ``train.py --sample``).

Greedy generation is checked against a step-by-step NumPy argmax over ``model.apply`` logits of the
exact context (no buffer, no padding), so the buffer, the per-row lengths and the sliding window are
all re-derived independently. Sizes are tiny and compute is fp32.
"""

import os
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from loco_jax.training.data import tokenizers
from loco_jax.training.data import tokens as tokens_lib
from loco_jax.training import model as M
from loco_jax.training.run import sample, sample_command
from loco_jax.training.run.steps import model_config
from tests.helpers import ROOT, quiet, small_config

# max_seq_len 8 so that short generations already slide (and the reference compiles few shapes);
# init_std 0.1 spreads the logits of a random model, so no greedy step is a near-tie rounding could flip.
CFG = M.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, d_ff=64, max_seq_len=8,
                    compute_dtype="float32", init_std=0.1)
PROMPT = np.random.RandomState(0).randint(0, CFG.vocab_size, size=(3, 5)).astype(np.int32)
LENGTHS = np.array([5, 2, 3], np.int32)  # rows 1 and 2 are right-padded
LENGTH = 12  # 5 + 12 > 8: every row slides


@pytest.fixture(scope="module")
def params():
    return M.init_params(CFG, jax.random.PRNGKey(0))


_apply = jax.jit(M.apply, static_argnums=0)  # the model's forward pass, compiled once per context length


def _last_logits(cfg, params, context):
    return np.asarray(_apply(cfg, params, context[None]))[0, -1]


def _greedy_reference(cfg, params, prompt, lengths, length, window):
    out = np.zeros((len(prompt), length), np.int32)
    for b in range(len(prompt)):
        seq = list(prompt[b, : lengths[b]])
        for i in range(length):
            logits = _last_logits(cfg, params, np.array(seq[-window:], np.int32))
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] > 1e-4, "a near-tie: rounding could flip the argmax; change the seed"
            out[b, i] = int(np.argmax(logits))
            seq.append(out[b, i])
    return out


def test_greedy_equals_stepwise_argmax_of_the_forward_logits(params):
    got = np.asarray(M.generate(CFG, params, PROMPT, LENGTH, prompt_lengths=LENGTHS))
    assert got.shape == (3, LENGTH) and got.dtype == np.int32
    np.testing.assert_array_equal(got, _greedy_reference(CFG, params, PROMPT, LENGTHS, LENGTH, CFG.max_seq_len))


def test_a_smaller_window_slides_earlier_and_still_matches(params):
    got = np.asarray(M.generate(CFG, params, PROMPT[:1, :3], 6, window=4))
    np.testing.assert_array_equal(got, _greedy_reference(CFG, params, PROMPT[:1, :3], [3], 6, 4))


def test_samples_stay_in_the_vocabulary_with_the_right_length(params):
    key = jax.random.key(0)
    out = np.asarray(M.generate(CFG, params, PROMPT, LENGTH, key=key, temperature=1.5, prompt_lengths=LENGTHS))
    assert out.shape == (3, LENGTH) and out.dtype == np.int32
    assert out.min() >= 0 and out.max() < CFG.vocab_size
    assert len(np.unique(out)) > 10  # a hot temperature spreads over the vocabulary
    small = np.asarray(M.generate(CFG, params, PROMPT, LENGTH, key=key, temperature=1.5, prompt_lengths=LENGTHS,
                                  vocab_size=7))
    assert small.max() < 7  # a tokenizer smaller than the model's vocabulary
    assert M.generate(CFG, params, PROMPT, 0).shape == (3, 0)


def test_sampling_is_deterministic_given_the_key(params):
    draw = lambda seed: np.asarray(M.generate(CFG, params, PROMPT, LENGTH, key=jax.random.key(seed), temperature=1.0,
                                              prompt_lengths=LENGTHS))
    a, b, c = draw(3), draw(3), draw(4)
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()
    greedy = np.asarray(M.generate(CFG, params, PROMPT, LENGTH, prompt_lengths=LENGTHS))
    assert (a != greedy).any()


def test_top_k_samples_only_among_the_k_likeliest(params):
    k, n = 3, 8
    out = np.asarray(M.generate(CFG, params, PROMPT, n, key=jax.random.key(0), temperature=2.0, top_k=k,
                                prompt_lengths=LENGTHS))
    for b in range(len(PROMPT)):
        seq = list(PROMPT[b, : LENGTHS[b]])
        for i in range(n):
            logits = _last_logits(CFG, params, np.array(seq[-CFG.max_seq_len :], np.int32))
            assert out[b, i] in np.argsort(logits)[-k:], (b, i)
            seq.append(out[b, i])
    top1 = M.generate(CFG, params, PROMPT, n, key=jax.random.key(0), temperature=2.0, top_k=1, prompt_lengths=LENGTHS)
    np.testing.assert_array_equal(top1, M.generate(CFG, params, PROMPT, n, prompt_lengths=LENGTHS))


@pytest.mark.parametrize(
    "args,kwargs,match",
    [
        ((PROMPT[0], 4), {}, "prompt must be"),
        ((PROMPT.astype(np.float32), 4), {}, "integer token ids"),
        ((np.zeros((2, 0), np.int32), 4), {}, "prompt length 0"),
        ((np.zeros((1, 9), np.int32), 4), {}, "prompt length 9"),
        ((PROMPT, -1), {}, "length=-1"),
        ((PROMPT, 4), {"temperature": 0.5}, "needs a PRNG key"),
        ((PROMPT, 4), {"temperature": -1.0}, "temperature=-1.0"),
        ((PROMPT, 4), {"top_k": 0}, "top_k=0"),
        ((PROMPT, 4), {"window": 9}, "window=9"),
        ((PROMPT, 4), {"vocab_size": 65}, "vocab_size=65"),
        ((PROMPT, 4), {"prompt_lengths": [5, 0, 3]}, "prompt_lengths"),
    ],
)
def test_bad_arguments_raise_before_compiling(params, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        M.generate(CFG, params, *args, **kwargs)


# ---------------------------------------------------------------------------- the samples block


def test_escape_keeps_each_sample_on_one_printable_line():
    assert sample.escape("to be,\n\tor not\\\x07\u2028é") == "to be,\\n\\tor not\\\\\\x07\\u2028é"


def test_default_prompts_are_line_starts_of_the_eval_text(text_file):  # noqa: F811
    data = tokens_lib.load_data(text_file)
    prompts = sample.default_prompts(data, 3)
    eval_lines = data.corpus.eval_text.splitlines()
    assert len(prompts) == 3 and len(set(prompts)) == 3
    assert all(len(p.split()) == sample.PROMPT_WORDS and any(line.startswith(p) for line in eval_lines)
               for p in prompts)
    tokens = tokens_lib.TokenData(np.arange(100, dtype=np.uint16), np.arange(50, dtype=np.uint16), 100)
    ids = sample.default_prompts(tokens, 2)  # a token-file run: id prompts from the eval stream
    assert [len(p) for p in ids] == [sample.PROMPT_TOKENS] * 2 and all(p[0] < 50 for p in ids)
    # Shards: a tokenizer but no text at hand, so id prompts too (shown decoded by format_samples).
    shard_like = tokens_lib.TokenData(tokens.train_tokens, tokens.eval_tokens, 256, tokenizers.ByteTokenizer())
    assert sample.default_prompts(shard_like, 2) == ids
    assert sample.default_prompts(None, 2) == ["\n", "\n"]


def _stub_trainer(text_file, params, step=None):  # noqa: F811
    """What print_samples reads of a Trainer: cfg, dataset.tokens and eval_params (the global parameters)."""
    cfg = small_config(text_file)
    tokens = tokens_lib.load_data(text_file)
    opt_state = types.SimpleNamespace(step=np.int32(step)) if step is not None else None
    return (types.SimpleNamespace(cfg=cfg, dataset=types.SimpleNamespace(tokens=tokens), eval_params=lambda s: params),
            types.SimpleNamespace(params=None, opt_state=opt_state))


def test_print_samples_logs_the_global_parameters_continuations(text_file):  # noqa: F811
    cfg = small_config(text_file)
    params = M.init_params(model_config(cfg), jax.random.PRNGKey(0))
    trainer, state = _stub_trainer(text_file, params, step=7)
    logged = []
    lines = sample.print_samples(trainer, state, logged.append, length=12, temperature=0)
    assert logged == ["\n".join(lines)]  # one block, one log call
    assert lines[0] == "samples (step 7, greedy, 12 tokens each, global parameters):"
    prompts = sample.default_prompts(trainer.dataset.tokens, 3)
    expected = sample.samples(cfg, params, tokenizers.ByteTokenizer(), prompts=prompts, length=12, temperature=0)
    assert lines[1:] == [f'  "{p}" -> "{sample.escape(t)}"' for p, t in zip(prompts, expected)]
    assert all(len(t.encode("utf-8", "replace")) >= 12 for t in expected)  # 12 bytes (U+FFFD is 3)


def test_print_samples_is_silent_off_process_0(text_file, monkeypatch):  # noqa: F811
    cfg = small_config(text_file)
    trainer, state = _stub_trainer(text_file, M.init_params(model_config(cfg), jax.random.PRNGKey(0)))
    monkeypatch.setattr(sample.jax, "process_index", lambda: 1)
    logged = []
    assert sample.print_samples(trainer, state, logged.append) is None and logged == []


def test_params_on_one_device_from_a_replicated_mesh_copy(params, mesh):
    from jax.sharding import NamedSharding, PartitionSpec as P

    replicated = jax.device_put(params, NamedSharding(mesh, P()))
    one = sample.on_one_device(replicated)
    assert all(x.devices() == {jax.local_devices()[0]} for x in jax.tree.leaves(one))
    jax.tree.map(np.testing.assert_array_equal, one, params)


# ---------------------------------------------------------------------------- python train.py --sample


def _sample_cmd(workdir, *extra):
    return [sys.executable, os.path.join(ROOT, "train.py"), "--sample", "--workdir", workdir, *extra]


def _env():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    env.pop("XLA_FLAGS", None)
    return env


def test_train_py_sample_prints_the_checkpoints_samples(text_file, tmp_path):  # noqa: F811
    from loco_jax.training.run import loop
    from loco_jax.training.run.trainer import Trainer

    # data parallel, exact mean: one step program, so the tiny run is cheap
    cfg = small_config(text_file, steps=2, checkpoint_every=2, eval_every=2,
                       **{"diloco.enabled": False, "mesh.replicas": 1, "loco.bits": "None"})
    workdir = str(tmp_path / "run")
    loop.train_and_evaluate(cfg, workdir, log=quiet)
    proc = subprocess.run(_sample_cmd(workdir, "--temperature", "0", "--sample-length", "16", "--prompt", "the of",
                                      "--prompt", "said"),
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.splitlines()
    head = out.index("samples (step 2, greedy, 16 tokens each, global parameters):")
    shown = out[head + 1 : head + 3]
    assert [re.match(r'  "(.*)" -> "(.*)"$', line).group(1) for line in shown] == ["the of", "said"], out
    # the same lines as generating in this process from the restored checkpoint's parameters
    trainer = Trainer(cfg, workdir, quiet)
    state, meta = sample_command.restore_latest(trainer, workdir, quiet)
    assert meta["step"] == 2
    expected = sample.samples(trainer.cfg, trainer.eval_params(state), trainer.dataset.tokens.tokenizer,
                              prompts=["the of", "said"], length=16, temperature=0)
    assert shown == [f'  "{p}" -> "{sample.escape(t)}"' for p, t in zip(["the of", "said"], expected)]


def test_train_py_sample_without_a_checkpoint_fails_clearly(tmp_path):
    workdir = str(tmp_path / "never_trained")
    os.makedirs(workdir)
    proc = subprocess.run(_sample_cmd(workdir), env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"no checkpoint in {os.path.join(workdir, 'checkpoints')}" in proc.stderr, proc.stderr
    assert "train first" in proc.stderr and "Traceback" not in proc.stderr
    assert os.listdir(workdir) == []  # nothing written
