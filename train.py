"""Entry point: ``python train.py --config configs/NAME.py [--workdir DIR] [--set key=value ...]``.

Rerunning the same command in the same workdir resumes from its latest
checkpoint. On a GPU pod run the same command on every host, with
``--coordinator HOST:PORT --num-processes N --process-id I`` (or the
``LOCO_JAX_*`` environment variables).

``--sample`` trains nothing: it restores the workdir's latest checkpoint (with
the run's own ``config.json``; ``--set`` may still change the mesh) and prints
a few lines generated from the global parameters (``--sample-length``,
``--temperature``, ``--top-k``, ``--sample-seed``, ``--prompt``).
"""

import argparse
import os
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description="Train a transformer with LoCo and Streaming DiLoCo.")
    parser.add_argument("--config", default="configs/tiny.py", help="a configs/NAME.py file (default: %(default)s)")
    parser.add_argument("--workdir", default=None, help="run directory (default: workdir/<config name>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set diloco.sync_every=50 (repeatable)")
    parser.add_argument("--plot", action="store_true", help="only (re)draw loss.png from the workdir's metrics")
    parser.add_argument("--sample", action="store_true",
                        help="no training: print text generated from the global parameters of the workdir's latest "
                             "checkpoint (the run's config.json is used; --config only names the default workdir)")
    parser.add_argument("--sample-length", type=int, default=None, metavar="N",
                        help="--sample: tokens to generate per prompt (default 64)")
    parser.add_argument("--temperature", type=float, default=None,
                        help="--sample: sampling temperature, 0 for greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, default=None, help="--sample: sample among the k likeliest tokens")
    parser.add_argument("--sample-seed", type=int, default=0, help="--sample: seed of the sampling key (default 0)")
    parser.add_argument("--prompt", dest="prompts", action="append", default=None, metavar="TEXT",
                        help="--sample: a prompt (repeatable; default: the first words of lines of the eval text)")
    parser.add_argument("--coordinator", default=None, help="multi-host: coordinator HOST:PORT")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    parser.add_argument("--local-devices", type=int, default=None,
                        help="CPU only: simulate this many devices per process (default 8 on a single CPU process)")
    args = parser.parse_args(argv)

    # Everything that can be checked without devices is checked before jax starts.
    from loco_jax import config as config_lib

    workdir = args.workdir or os.path.join("workdir", os.path.splitext(os.path.basename(args.config))[0])
    sample_options = {k: v for k, v in (("length", args.sample_length), ("temperature", args.temperature),
                                         ("top_k", args.top_k), ("prompts", args.prompts)) if v is not None}
    if not args.sample and (sample_options or args.sample_seed):
        parser.error("--sample-length, --temperature, --top-k, --sample-seed and --prompt go with --sample.")
    if args.sample:
        from loco_jax.training import sample

        if args.plot:
            parser.error("--sample and --plot are separate commands; give one.")
        if args.sample_length is not None and args.sample_length < 1:
            parser.error(f"--sample-length={args.sample_length} must be >= 1.")
        if args.temperature is not None and not args.temperature >= 0:
            parser.error(f"--temperature={args.temperature} must be >= 0 (0: greedy).")
        try:
            sample.latest_checkpoint_step(workdir)
        except FileNotFoundError as e:
            parser.exit(1, f"train.py --sample: {e}\n")
    else:
        cfg = config_lib.load(args.config, args.overrides)
    if args.plot:
        from loco_jax import trainer

        print(trainer.plot(workdir))
        return 0

    from loco_jax import mesh

    if args.local_devices is None and not os.environ.get("JAX_PLATFORMS", "").startswith(("cuda", "gpu", "tpu")):
        args.local_devices = 8 if args.num_processes in (None, 1) else None
    mesh.initialize(args.coordinator, args.num_processes, args.process_id, local_device_count=args.local_devices)

    if args.sample:
        sample.sample_workdir(workdir, args.overrides, seed=args.sample_seed, **sample_options)
        return 0

    from loco_jax import trainer

    summary = trainer.train_and_evaluate(cfg, workdir)
    print(f"done: step {summary['last_step']}, eval loss {summary['eval_loss']}; workdir {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
