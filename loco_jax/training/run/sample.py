"""Text generated from a run's global parameters: what the model learned, next to its loss.

- :func:`samples`: continuations of a few prompts (greedy or temperature / top-k sampling with
  :func:`loco_jax.training.model.generate`), decoded with the run's tokenizer.
- :func:`print_samples`: the block the loop logs at the end of a run, from the *global* parameters
  (``trainer.eval_params(state)``: DiLoCo's outer parameters, or the data-parallel parameters)::

      samples (step 300, temperature 0.8, 64 tokens each, global parameters):
        "KING HENRY" -> " VIII. I will not so much the sea\\n  ..."


``python train.py --sample`` (restore a workdir's latest checkpoint and print that block, without
training) is :mod:`loco_jax.training.run.sample_command`, which builds a Trainer; this module does not.

Generation runs on **one device** with a copy of the global parameters: the trainer's are
replicated over the whole mesh (``P()``), so each leaf's copy on this process's first device is
used as is (no transfer, no extra memory). A leaf sharded over devices of several processes (not
the case for this trainer's global parameters, but possible for other layouts) can only be
gathered by every process together; :func:`print_samples` therefore runs that gather on every
process and only then returns on processes other than 0, which print nothing. Call it on every
process.

Cost: ``length`` forward passes over ``min(seq_len, prompt + length)`` positions for ``num``
prompts at once, plus one compile: about a second or two for the tiny CPU models.
"""

from __future__ import annotations


import jax
import numpy as np

from loco_jax.training import model as model_lib

__all__ = [
    "DEFAULT_LENGTH",
    "DEFAULT_NUM",
    "DEFAULT_TEMPERATURE",
    "default_prompts",
    "escape",
    "format_samples",
    "on_one_device",
    "print_samples",
    "samples",
]

DEFAULT_NUM = 3
DEFAULT_LENGTH = 64
DEFAULT_TEMPERATURE = 0.8
PROMPT_WORDS = 2  # default prompts: the first words of a line
PROMPT_MAX_CHARS = 24
PROMPT_TOKENS = 8  # token-file runs (no tokenizer): this many eval tokens per prompt


# ---------------------------------------------------------------------------- prompts and text


def escape(text: str) -> str:
    """``text`` on one line: backslash, newline, tab and every other non-printable character escaped
    as Python writes them (``\\n``, ``\\t``, ``\\x07``, ``\\u2028``); printable text is left as is."""
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c.isprintable():
            out.append(c)
        else:
            out.append(repr(c)[1:-1])  # '\n', '\t', '\x07', '\u2028', ...
    return "".join(out)


def _line_prompts(text: str, num: int) -> list[str]:
    """The first words of ``num`` lines spread evenly over ``text`` (the centres of ``num`` equal parts)."""
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if len(line.split()) >= 2 and any(c.isalpha() for c in line)]
    if not lines:
        return []
    picks = [lines[(2 * k + 1) * len(lines) // (2 * num)] for k in range(num)]
    out = []
    for line in picks:
        prompt = " ".join(line.split()[:PROMPT_WORDS])[:PROMPT_MAX_CHARS]
        out.append(prompt)
    return out


def default_prompts(data, num: int = DEFAULT_NUM) -> list:
    """``num`` short prompts from a run's data (a :class:`~loco_jax.training.data.tokens.TokenData` or None).

    Text data: the first words of ``num`` lines spread over the eval text (the training text when no
    eval text was held out), so the model continues text like the text it was judged on. Token files and
    shards (no text at hand): the first :data:`PROMPT_TOKENS` ids of ``num`` spread positions of the eval
    stream, as lists of ints (shown as text where the data knows its tokenizer). Nothing to go on: a
    newline each.
    """
    if num < 1:
        raise ValueError(f"num={num} must be >= 1.")
    corpus = getattr(data, "corpus", None)
    if corpus is not None and getattr(data, "tokenizer", None) is not None:
        prompts = _line_prompts(corpus.eval_text, num) or _line_prompts(corpus.train_text, num)
        if prompts:
            return prompts
    if data is not None:  # token files and shards (decoded for display where they know their tokenizer)
        for stream in (data.eval_tokens, data.train_tokens):
            if len(stream) >= PROMPT_TOKENS:
                last = len(stream) - PROMPT_TOKENS
                starts = [(2 * k + 1) * last // (2 * num) for k in range(num)]
                return [[int(t) for t in stream[s : s + PROMPT_TOKENS]] for s in starts]
    return ["\n"] * num


def _encode(tokenizer, prompt) -> np.ndarray:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"prompt {prompt!r} is text, but this run has no tokenizer (a token-file run): "
                             "give prompts as lists of token ids.")
        ids = np.asarray(tokenizer.encode(prompt), np.int64)
    else:
        ids = np.asarray(prompt, np.int64).reshape(-1)
    if ids.size == 0:
        raise ValueError(f"prompt {prompt!r} encodes to no tokens; give at least one token.")
    return ids


def _decode(tokenizer, ids) -> str:
    ids = np.asarray(ids).reshape(-1)
    if tokenizer is None:
        return " ".join(str(int(i)) for i in ids)
    return tokenizer.decode(ids)


def _show(tokenizer, prompt) -> str:
    return prompt if isinstance(prompt, str) else _decode(tokenizer, prompt)


# ---------------------------------------------------------------------------- generation


def _is_local_copy(x) -> bool:
    return not isinstance(x, jax.Array) or x.is_fully_addressable or x.sharding.is_fully_replicated


def on_one_device(params, device=None):
    """``params`` with every leaf on one device (``device``, default this process's first device).

    A replicated leaf gives its own copy on that device (no transfer when it has one there); a leaf
    sharded within this process is assembled on it; a leaf sharded across processes is all-gathered
    (``multihost_utils.process_allgather``): a collective, so then every process must call this.
    """
    device = device or jax.local_devices()[0]

    def one(x):
        if not isinstance(x, jax.Array):
            return jax.device_put(np.asarray(x), device)
        if x.sharding.is_fully_replicated:
            for shard in x.addressable_shards:
                if shard.device == device:
                    return shard.data
            return jax.device_put(x.addressable_shards[0].data, device)
        if x.is_fully_addressable:
            # through the host: device_put of an explicitly sharded array onto one device keeps the sharded
            # type (its aval still reads e.g. f32[256@data, 32]), which the sampler's gathers then refuse
            return jax.device_put(np.asarray(jax.device_get(x)), device)
        from jax.experimental import multihost_utils

        return jax.device_put(multihost_utils.process_allgather(x, tiled=True), device)

    return jax.tree.map(one, params)


def _model_and_window(cfg):
    """(ModelConfig, context window) from a training ``Config`` (window: its ``seq_len``) or a ModelConfig."""
    if isinstance(cfg, model_lib.ModelConfig):
        return cfg, cfg.max_seq_len
    from loco_jax.training.run.steps import model_config

    mcfg = model_config(cfg)
    return mcfg, min(int(cfg.seq_len), mcfg.max_seq_len)


def samples(
    cfg, params, tokenizer, *, prompts=None, num: int = DEFAULT_NUM, length: int = DEFAULT_LENGTH,
    temperature: float = DEFAULT_TEMPERATURE, top_k: int | None = None, seed: int = 0,
    eval_text: str | None = None,
) -> list[str]:
    """The continuation (decoded text) of each prompt, generated by the model with ``params``.

    Args:
      cfg: the run's training ``Config`` (the model's context is then its ``seq_len``, the length it
        was trained at) or a :class:`~loco_jax.training.model.ModelConfig` (context ``max_seq_len``).
      params: the parameter dict; moved to one device first (:func:`on_one_device`).
      tokenizer: the run's tokenizer (``encode``/``decode``/``vocab_size``), or ``None`` for a
        token-file run: prompts are then lists of ids and continuations are ids joined by spaces.
      prompts: strings (encoded with ``tokenizer``) or lists of token ids; a prompt longer than the
        context keeps its last tokens. ``None``: the first words of ``num`` lines of ``eval_text``,
        or newlines when none is given.
      num: how many default prompts (ignored when ``prompts`` is given).
      length: tokens to generate per prompt.
      temperature: 0 is greedy; otherwise sampling at this temperature (``top_k`` to restrict it).
      seed: the sampling key is ``jax.random.key(seed)``: the same seed gives the same text.
      eval_text: text to take the default prompts from.
    """
    if prompts is None:
        prompts = (_line_prompts(eval_text, num) if eval_text else []) or ["\n"] * num
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty; give at least one prompt (or prompts=None for the defaults).")
    mcfg, window = _model_and_window(cfg)
    ids = [_encode(tokenizer, p)[-window:] for p in prompts]
    vocab = mcfg.vocab_size if tokenizer is None else min(int(tokenizer.vocab_size), mcfg.vocab_size)
    for p, row in zip(prompts, ids):
        if row.min() < 0 or row.max() >= vocab:
            raise ValueError(f"prompt {p!r} holds token ids outside [0, {vocab}).")
    width = max(len(row) for row in ids)
    batch = np.zeros((len(ids), width), np.int32)
    for b, row in enumerate(ids):
        batch[b, : len(row)] = row
    out = model_lib.generate(
        mcfg, on_one_device(params), batch, int(length), key=jax.random.key(seed), temperature=temperature,
        top_k=top_k, prompt_lengths=np.array([len(r) for r in ids], np.int32), window=window, vocab_size=vocab,
    )
    return [_decode(tokenizer, row) for row in np.asarray(out)]


def format_samples(prompts, continuations, *, tokenizer=None, step=None, temperature=DEFAULT_TEMPERATURE,
                   length=DEFAULT_LENGTH, top_k=None) -> list[str]:
    """The lines of the samples block: a header, then ``  "prompt" -> "continuation"`` per prompt, escaped."""
    what = [f"step {step}"] if step is not None else []
    what.append("greedy" if temperature == 0 else f"temperature {temperature:g}")
    if top_k is not None and temperature != 0:
        what.append(f"top-k {top_k}")
    what.append(f"{length} tokens each, global parameters")
    lines = [f"samples ({', '.join(what)}):"]
    for prompt, text in zip(prompts, continuations):
        lines.append(f'  "{escape(_show(tokenizer, prompt))}" -> "{escape(text)}"')
    return lines


def _state_step(state):
    step = getattr(getattr(state, "opt_state", None), "step", None)  # DiLoCo counts its steps; DP does not
    try:
        return None if step is None else int(step)
    except (TypeError, ValueError):
        return None


def print_samples(trainer, state, log=print, *, step: int | None = None, prompts=None, num: int = DEFAULT_NUM,
                  length: int = DEFAULT_LENGTH, temperature: float = DEFAULT_TEMPERATURE, top_k: int | None = None,
                  seed: int = 0) -> list[str] | None:
    """Logs a few continuations generated from the run's global parameters; returns the lines.

    Call it on **every** process: the global parameters are brought to one device of process 0
    (:func:`on_one_device`; a collective only for a leaf sharded across processes), then processes
    other than 0 return None and log nothing. The tokenizer and the default prompts (the first words
    of lines of the eval text) come from the trainer's dataset; ``step`` labels the block (default:
    DiLoCo's own step count, else no label).
    """
    params = trainer.eval_params(state)
    if not all(_is_local_copy(x) for x in jax.tree.leaves(params)):
        params = on_one_device(params)  # the gather every process takes part in
    if jax.process_index() != 0:
        return None
    data = trainer.dataset.tokens
    tokenizer = data.tokenizer
    prompts = default_prompts(data, num) if prompts is None else list(prompts)
    continuations = samples(trainer.cfg, params, tokenizer, prompts=prompts, length=length, temperature=temperature,
                            top_k=top_k, seed=seed)
    lines = format_samples(prompts, continuations, tokenizer=tokenizer, temperature=temperature, length=length,
                           top_k=top_k, step=_state_step(state) if step is None else step)
    log("\n".join(lines))
    return lines
