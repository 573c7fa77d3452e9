"""Texts to tokens to batches: corpora, tokenizers, token files and shard directories (no run in sight)."""
