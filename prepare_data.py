"""Tokenize your text once into memory-mapped token shards that ``train.py`` reads with ``--set data.path=DIR``.

    python prepare_data.py --input corpus/ more.jsonl --output /data/shards \\
        --tokenizer sentencepiece --vocab-size 32000

Inputs: ``.txt`` files (one document each) and ``.jsonl`` files (one document per line, the text in
``--text-field``), gzipped or not, or directories of them (searched recursively). The tokenizer is a
SentencePiece BPE model trained on ``--sample-chars`` characters spread over the input (saved as
``DIR/tokenizer.model``), an existing model (``--sp-model``), or UTF-8 bytes (``--tokenizer byte``).
Every ``--eval-every``-th document is held out for evaluation. The layout, the manifest and the
guarantees are in ``loco_jax/training/data/shard_format.py``.
"""

import argparse
import shlex
import sys


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    from loco_jax.training.data import prepare
    from loco_jax.training.data import shard_format
    from loco_jax.training.data import shard_reader

    p = argparse.ArgumentParser(description="Tokenize text into token shards for train.py (--set data.path=DIR).")
    p.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                   help="text files, .jsonl files (.gz too) or directories of them")
    p.add_argument("--output", "-o", required=True, metavar="DIR", help="the shard directory to write")
    p.add_argument("--tokenizer", choices=("sentencepiece", "byte"), default="sentencepiece",
                   help="default: %(default)s")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="SentencePiece: the vocabulary to train (the 1B recipe uses 32000)")
    p.add_argument("--sp-model", default=None, metavar="FILE",
                   help="SentencePiece: use this existing model instead of training one")
    p.add_argument("--sample-chars", type=int, default=shard_format.DEFAULT_SAMPLE_CHARS,
                   help="characters of text to train the SentencePiece model on (default: %(default)s)")
    p.add_argument("--shard-tokens", type=int, default=shard_format.DEFAULT_SHARD_TOKENS,
                   help="tokens per shard (default: %(default)s)")
    p.add_argument("--eval-every", type=int, default=shard_format.DEFAULT_EVAL_EVERY,
                   help="hold out every N-th document for evaluation (default: %(default)s); with fewer "
                        "documents, the last --eval-tail of the tokens")
    p.add_argument("--eval-tail", type=float, default=shard_format.DEFAULT_EVAL_TAIL,
                   help="share of the tokens held out when no whole document is (default: %(default)s)")
    p.add_argument("--text-field", default="text", help="the field of a .jsonl line that holds the text "
                                                         "(default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="SentencePiece encoding threads (default: all cores)")
    p.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    p.add_argument("--verify", action="store_true", help="re-read every shard against its SHA-256 when done")
    args = p.parse_args(argv)
    if args.tokenizer == "sentencepiece" and args.sp_model is None and args.vocab_size is None:
        p.error("--tokenizer sentencepiece needs --vocab-size N (to train a model) or --sp-model FILE")

    progress = prepare.TextProgress()
    try:
        manifest = prepare.prepare(
            args.input, args.output, tokenizer=args.tokenizer, vocab_size=args.vocab_size, sp_model=args.sp_model,
            sample_chars=args.sample_chars, shard_tokens=args.shard_tokens, eval_every=args.eval_every,
            eval_tail=args.eval_tail, text_field=args.text_field, threads=args.threads, overwrite=args.overwrite,
            progress=progress, command=shlex.join(["python", "prepare_data.py", *argv]),
        )
        progress.close()
        if args.verify:
            last = [0, 0]

            def verifying(done, total):
                last[:] = done, total
                progress("verifying", done, total)

            shard_reader.verify_shards(args.output, progress=verifying)
            progress("verifying", *last, final=True)
            progress.close()
            print(f"verified every shard of {args.output} against its SHA-256")
    except (OSError, ValueError) as e:
        progress.close()
        print(f"prepare_data.py: error: {e}", file=sys.stderr)
        return 1
    tok = manifest["tokenizer"]
    flags = [f"--set data.path={args.output}", f"--set data.tokenizer={tok['kind']}",
             f"--set model.vocab_size={tok['vocab_size']}"]
    if tok["kind"] == "sentencepiece":
        flags[2:2] = [f"--set data.sp_vocab_size={tok['vocab_size']}",
                      f"--set data.sp_model={args.output}/{tok['model_file']}"]
    print("train on it with:\n    python train.py --config configs/NAME.py " + " ".join(flags))
    return 0


if __name__ == "__main__":
    sys.exit(main())
