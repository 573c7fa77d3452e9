"""Token shards: a directory of memory-mapped token files described by a JSON manifest, made once by
``prepare_data.py`` and trained on through ``data.path``. One module per job; this one gathers their public
names (``shards.open_shards``, ``shards.prepare``, ...):

- :mod:`loco_jax.training.shard_format`: the directory and its manifest (schema, validation, reading and
  writing the manifest, the constants of the format);
- :mod:`loco_jax.training.shard_reader`: reading: a lazy concatenation of memory-mapped shards, the
  checks made when a directory is opened (files, sizes, the tokenizer), :func:`verify_shards`;
- :mod:`loco_jax.training.shard_writer`: writing shard files and their manifest;
- :mod:`loco_jax.training.prepare`: ``prepare_data.py``'s pipeline (input files, document pieces, the
  encoder, the progress line) and the message a pod recipe gives without data.
"""

from loco_jax.training.prepare import (  # noqa: F401
    TextProgress, find_inputs, iter_pieces, missing_path_message, pieces_are_exact, prepare,
)
from loco_jax.training.shard_format import (  # noqa: F401
    DEFAULT_EVAL_EVERY, DEFAULT_EVAL_TAIL, DEFAULT_SAMPLE_CHARS, DEFAULT_SHARD_TOKENS, FORMAT, MANIFEST, OPEN_SHARDS,
    PIECE_CHARS, SPLITS, TOKENIZER_FILE, VERSION, holds_shard_files, is_shard_dir, read_manifest, token_dtype,
    validate_manifest, write_manifest,
)
from loco_jax.training.shard_reader import (  # noqa: F401
    ShardedTokens, ShardSet, check_tokenizer, open_shards, verify_shards,
)
from loco_jax.training.shard_writer import ShardWriter, write_token_shards  # noqa: F401

__all__ = [
    "DEFAULT_EVAL_EVERY",
    "DEFAULT_SAMPLE_CHARS",
    "DEFAULT_SHARD_TOKENS",
    "FORMAT",
    "MANIFEST",
    "ShardSet",
    "ShardWriter",
    "ShardedTokens",
    "TextProgress",
    "VERSION",
    "check_tokenizer",
    "find_inputs",
    "holds_shard_files",
    "is_shard_dir",
    "iter_pieces",
    "missing_path_message",
    "open_shards",
    "pieces_are_exact",
    "prepare",
    "read_manifest",
    "token_dtype",
    "validate_manifest",
    "verify_shards",
    "write_manifest",
    "write_token_shards",
]
