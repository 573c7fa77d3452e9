"""The data of a run: the config's token streams and this process's rows of each global batch."""

from __future__ import annotations

import jax

from loco_jax.training.data import batches
from loco_jax.training.data import prepare
from loco_jax.training.data import tokens
from loco_jax.training.run import config as config_lib


class Dataset:
    """Token streams of the config and this process's rows of each global batch.

    Loading checks everything about the data before anything compiles: a config with
    ``data.require_path`` and no ``data.path`` is refused with the ``prepare_data.py`` command to run;
    missing, empty or corrupt files, shards whose manifest's tokenizer differs from the config's, and
    token ids beyond ``model.vocab_size`` are refused by name.
    """

    def __init__(self, cfg: config_lib.Config, log=print):
        d = cfg.data
        if d.path is None and d.require_path:
            raise ValueError(prepare.missing_path_message(d.tokenizer, d.sp_vocab_size))
        sp = d.tokenizer == "sentencepiece"
        self.tokens = tokens.load_data(
            d.path, tokenizer=d.tokenizer, vocab_size=d.sp_vocab_size if sp else None, cache_dir=d.cache_dir,
            sp_model=d.sp_model,
        )
        is_shards = self.tokens.shards is not None
        if self.tokens.vocab_size > cfg.model.vocab_size:
            if is_shards:
                source = f"the token shards in {d.path!r}"
            elif d.path and tokens.is_token_file(d.path):
                source = f"the token file {d.path!r}"
            else:
                source = f"the {d.tokenizer} tokenizer"
            raise ValueError(
                f"{source} uses {self.tokens.vocab_size} token ids but model.vocab_size={cfg.model.vocab_size}; "
                f"raise model.vocab_size to at least {self.tokens.vocab_size}."
            )
        for split, stream in (("train", self.tokens.train_tokens), ("eval", self.tokens.eval_tokens)):
            if len(stream) < cfg.seq_len + 1:  # caught here, not at the first evaluation after compiling
                raise ValueError(
                    f"the {split} split of {d.path or 'the Shakespeare corpus'} holds {len(stream):,} tokens, fewer than "
                    f"one window of seq_len + 1 = {cfg.seq_len + 1}; give it more text"
                    + (" (prepare_data.py: a smaller --eval-every holds out more documents)" if split == "eval" else "")
                    + " or lower seq_len."
                )
        self.cfg = cfg
        self.process, self.processes = jax.process_index(), jax.process_count()
        what = f"({d.tokenizer} tokenizer)"
        if is_shards:
            note = "; set data.sp_model to check its SHA-256 too" if sp and d.sp_model is None else ""
            what = f"({self.tokens.shards.describe()}{note})"
        log(f"data: {self.tokens.source or 'shakespeare'}; {len(self.tokens.train_tokens):,} train and "
            f"{len(self.tokens.eval_tokens):,} eval tokens {what}")

    def train_iterator(self, seed, state=None):
        batcher = batches.Batcher(self.tokens.train_tokens, seq_len=self.cfg.seq_len, seed=seed)
        return _ProcessBatcher(batcher.restore(state) if state else batcher, self.process, self.processes)

    def eval_batches(self, batch_size, count):
        """The same ``count`` global batches every time: the first windows of the eval stream."""
        inputs, targets = batches.eval_windows(self.tokens.eval_tokens, seq_len=self.cfg.seq_len,
                                                max_windows=batch_size * count)
        rows = batches.process_rows(batch_size, self.process, self.processes)
        for b in range(len(inputs) // batch_size):
            chunk = slice(b * batch_size, (b + 1) * batch_size)
            yield inputs[chunk][rows], targets[chunk][rows]


class _ProcessBatcher:
    def __init__(self, batcher, process, processes):
        self.batcher, self.process, self.processes = batcher, process, processes

    def next_batch(self, global_batch):
        return self.batcher.next_batch(global_batch, process_index=self.process, num_processes=self.processes)

    def state(self):
        return self.batcher.state()


# ---------------------------------------------------------------------------- the run
