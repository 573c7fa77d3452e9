"""Entry point: ``python train.py --config configs/NAME.py [--workdir DIR] [--set key=value ...]``.

Rerunning the same command in the same workdir resumes from its latest
checkpoint. On a GPU pod run the same command on every host, with
``--coordinator HOST:PORT --num-processes N --process-id I`` (or the
``LOCO_JAX_*`` environment variables).
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
    parser.add_argument("--coordinator", default=None, help="multi-host: coordinator HOST:PORT")
    parser.add_argument("--num-processes", type=int, default=None, help="multi-host: number of processes")
    parser.add_argument("--process-id", type=int, default=None, help="multi-host: this process's index")
    parser.add_argument("--local-devices", type=int, default=None,
                        help="CPU only: simulate this many devices per process (default 8 on a single CPU process)")
    args = parser.parse_args(argv)

    # Everything that can be checked without devices is checked before jax starts.
    from loco_jax import config as config_lib

    cfg = config_lib.load(args.config, args.overrides)
    workdir = args.workdir or os.path.join("workdir", os.path.splitext(os.path.basename(args.config))[0])
    if args.plot:
        from loco_jax import trainer

        print(trainer.plot(workdir))
        return 0

    from loco_jax import mesh

    if args.local_devices is None and not os.environ.get("JAX_PLATFORMS", "").startswith(("cuda", "gpu", "tpu")):
        args.local_devices = 8 if args.num_processes in (None, 1) else None
    mesh.initialize(args.coordinator, args.num_processes, args.process_id, local_device_count=args.local_devices)

    from loco_jax import trainer

    summary = trainer.train_and_evaluate(cfg, workdir)
    print(f"done: step {summary['last_step']}, eval loss {summary['eval_loss']}; workdir {workdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
