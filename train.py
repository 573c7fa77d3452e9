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

from loco_jax.training.run.mesh import HEARTBEAT_TIMEOUT

# Multi-process default (README, "Reliability"): a run that completes no sync step in 30 minutes, compiling
# excluded, counts as hung (a pod's sync step takes seconds; a checkpoint of the 8B recipe, minutes).
DEFAULT_STEP_TIMEOUT = 1800


def config_flags_as_set(argv):
    """``--config.KEY=VALUE`` and ``--config.KEY VALUE`` (ml_collections' ``config_flags`` form, as in flax's
    examples) as ``--set KEY=VALUE``: the same typed fields and the same errors as ``--set``."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--config.") and len(arg) > len("--config."):
            key, eq, value = arg[len("--config."):].partition("=")
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(f"train.py: {arg} needs a value: {arg}=VALUE or {arg} VALUE.")
                i, value = i + 1, argv[i + 1]
            out += ["--set", f"{key}={value}"]
        else:
            out.append(arg)
        i += 1
    return out


def build_parser():
    """train.py's command line (every option, its default and its help)."""
    parser = argparse.ArgumentParser(description="Train a transformer with LoCo and Streaming DiLoCo.")
    parser.add_argument("--config", default="configs/tiny.py", help="a configs/NAME.py file (default: %(default)s)")
    parser.add_argument("--workdir", default=None, help="run directory (default: workdir/<config name>)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set diloco.sync_every=50 (repeatable; "
                             "--config.diloco.sync_every=50 is the same)")
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
    parser.add_argument("--heartbeat-timeout", type=int, default=None, metavar="SECONDS",
                        help="multi-host: seconds without a heartbeat after which a process counts as dead and the "
                             "others stop (default %d)" % HEARTBEAT_TIMEOUT)
    parser.add_argument("--step-timeout", type=float, default=None, metavar="SECONDS",
                        help="exit (status 124) when no sync step completes within this many seconds, compiling "
                             "excluded; 0: off (default: %d on a multi-process run, off on one process)"
                             % DEFAULT_STEP_TIMEOUT)
    parser.add_argument("--profile-steps", type=int, default=None, metavar="N",
                        help="write a jax.profiler trace of N steps (after the first, which compiles) to "
                             "WORKDIR/profile; view it in TensorBoard's Profile tab or Perfetto")
    parser.add_argument("--verbose", action="store_true",
                        help="print the full error (Python and runtime) when a peer process fails, not just the summary")
    return parser


def _check_sample_args(parser, args, workdir):
    """``--sample``'s options, and a checkpoint to sample from, checked before jax starts."""
    from loco_jax.training.run import sample_command

    if args.plot:
        parser.error("--sample and --plot are separate commands; give one.")
    if args.sample_length is not None and args.sample_length < 1:
        parser.error(f"--sample-length={args.sample_length} must be >= 1.")
    if args.temperature is not None and not args.temperature >= 0:
        parser.error(f"--temperature={args.temperature} must be >= 0 (0: greedy).")
    try:
        sample_command.latest_checkpoint_step(workdir)
    except FileNotFoundError as e:
        parser.exit(1, f"train.py --sample: {e}\n")


def main(argv=None):
    argv = config_flags_as_set(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.heartbeat_timeout is not None and args.heartbeat_timeout < 1:
        parser.error(f"--heartbeat-timeout={args.heartbeat_timeout} must be >= 1 second.")
    if args.step_timeout is not None and not args.step_timeout >= 0:
        parser.error(f"--step-timeout={args.step_timeout} must be >= 0 seconds (0: no watchdog).")

    # Everything that can be checked without devices is checked before jax starts.
    from loco_jax.training.run import config as config_lib

    workdir = args.workdir or os.path.join("workdir", os.path.splitext(os.path.basename(args.config))[0])
    sample_options = {k: v for k, v in (("length", args.sample_length), ("temperature", args.temperature),
                                         ("top_k", args.top_k), ("prompts", args.prompts)) if v is not None}
    if not args.sample and (sample_options or args.sample_seed):
        parser.error("--sample-length, --temperature, --top-k, --sample-seed and --prompt go with --sample.")
    if args.sample:
        from loco_jax.training.run import sample_command

        _check_sample_args(parser, args, workdir)
    else:
        cfg = config_lib.load(args.config, args.overrides)
    if args.plot:
        from loco_jax.training.run.metrics import plot

        print(plot(workdir))
        return 0

    from loco_jax.training.run import mesh

    if args.local_devices is None and not os.environ.get("JAX_PLATFORMS", "").startswith(("cuda", "gpu", "tpu")):
        args.local_devices = 8 if args.num_processes in (None, 1) else None
    from loco_jax.training.run import failure

    runtime_log = os.environ.get(failure.SUPERVISED_ENV)
    settings = mesh.distributed_settings(args.coordinator, args.num_processes, args.process_id)
    if settings and settings["num_processes"] > 1 and not args.sample and runtime_log is None:
        # this process only watches: the training process it starts is what an abort by the runtime ends
        guard = failure.Guard(workdir, settings["process_id"], settings["num_processes"], verbose=args.verbose)
        return failure.supervise([sys.executable, os.path.abspath(__file__), *argv], guard)
    if runtime_log is not None:  # the training process of a supervised run
        failure.die_with_supervisor()
        if runtime_log != "-":
            failure.runtime_messages_to(runtime_log)
    settings = mesh.initialize(args.coordinator, args.num_processes, args.process_id,
                               local_device_count=args.local_devices,
                               heartbeat_timeout=args.heartbeat_timeout or HEARTBEAT_TIMEOUT)
    step_timeout = args.step_timeout if args.step_timeout is not None else (
        DEFAULT_STEP_TIMEOUT if settings and settings["num_processes"] > 1 else 0)

    if args.sample:
        sample_command.sample_workdir(workdir, args.overrides, seed=args.sample_seed, **sample_options)
        return 0

    from loco_jax.training.run.loop import train_and_evaluate

    summary = train_and_evaluate(cfg, workdir, step_timeout=step_timeout or None, verbose=args.verbose,
                                 profile_steps=args.profile_steps)
    print(f"done: step {summary['last_step']}, eval loss {summary['eval_loss']}; workdir {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
