"""The data of a run: the config's token streams and this process's rows of each global batch."""

from __future__ import annotations

import jax

from loco_jax.training import config as config_lib
from loco_jax.training import data as data_lib


class Dataset:
    """Token streams of the config and this process's rows of each global batch."""

    def __init__(self, cfg: config_lib.Config, log=print):
        d = cfg.data
        sp = d.tokenizer == "sentencepiece"
        self.tokens = data_lib.load_data(
            d.path, tokenizer=d.tokenizer, vocab_size=d.sp_vocab_size if sp else None, cache_dir=d.cache_dir
        )
        if self.tokens.vocab_size > cfg.model.vocab_size:
            source = f"the token file {d.path!r}" if d.path and data_lib.is_token_file(d.path) else f"the {d.tokenizer} tokenizer"
            raise ValueError(
                f"{source} uses {self.tokens.vocab_size} token ids but model.vocab_size={cfg.model.vocab_size}; "
                f"raise model.vocab_size to at least {self.tokens.vocab_size}."
            )
        self.cfg = cfg
        self.process, self.processes = jax.process_index(), jax.process_count()
        log(f"data: {self.tokens.source or 'shakespeare'}; {len(self.tokens.train_tokens):,} train and "
            f"{len(self.tokens.eval_tokens):,} eval tokens ({d.tokenizer} tokenizer)")

    def train_iterator(self, seed, state=None):
        batcher = data_lib.Batcher(self.tokens.train_tokens, seq_len=self.cfg.seq_len, seed=seed)
        return _ProcessBatcher(batcher.restore(state) if state else batcher, self.process, self.processes)

    def eval_batches(self, batch_size, count):
        """The same ``count`` global batches every time: the first windows of the eval stream."""
        inputs, targets = data_lib.eval_windows(self.tokens.eval_tokens, seq_len=self.cfg.seq_len,
                                                max_windows=batch_size * count)
        rows = data_lib.process_rows(batch_size, self.process, self.processes)
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
