"""Programs a sync step's read dispatches: a tiny 2-replica Streaming DiLoCo run logging every ``--steps``.

    python benchmarks/sync_read.py [--steps 100] [--repo PATH]

Counts the programs the trainer takes from its program table during each ``_Window.read`` (every program
the loop runs goes through that table). Each one is waited for before the next, so a checkout whose read
puts many programs in flight (``--repo`` an older commit: ``git worktree add /tmp/old 51fbcaf``) is
counted instead of deadlocking XLA's CPU collectives. Prints one line per read: steps read, programs.
"""

import argparse
import os
import sys
import tempfile

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100, help="steps, and log_every (default %(default)s)")
    parser.add_argument("--repo", default=sys.path[0], help="the checkout to measure (default: this one)")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.abspath(args.repo))
    import jax

    from loco_jax.training.run import loop
    from loco_jax.training.run.trainer import Trainer
    from tests.helpers import small_config

    class Counting(dict):
        taken = 0

        def __getitem__(self, key):
            Counting.taken += 1
            program = super().__getitem__(key)
            return lambda *a, **k: jax.block_until_ready(program(*a, **k))

    init, read, reads = Trainer.__init__, loop.StepWindow.read, []

    def counting_init(self, *a, **k):
        init(self, *a, **k)
        self._programs = Counting(self._programs)

    def counted_read(self):
        before, n = Counting.taken, len(self.on_device)
        read(self)
        reads.append((n, Counting.taken - before))

    Trainer.__init__, loop.StepWindow.read = counting_init, counted_read
    words = "the of and to a in that is was he for it with as his on be at by this had not are but".split()
    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "text.txt")
        with open(text, "w") as f:
            f.write("\n".join(" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(4000)))
        cfg = small_config(text, steps=args.steps, log_every=args.steps, eval_every=args.steps,
                           checkpoint_every=args.steps, **{"loco.bits": "None", "diloco.num_fragments": 1})
        loop.train_and_evaluate(cfg, os.path.join(tmp, "run"), log=lambda *a: None)
    for n, taken in reads:
        print(f"read of {n} steps: {taken} program(s)")


if __name__ == "__main__":
    main()
