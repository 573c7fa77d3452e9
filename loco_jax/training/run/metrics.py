"""Metrics of a run: ``metrics.jsonl`` (one JSON row per log or eval step), the end-of-run table, the
loss plot and the progress line."""

from __future__ import annotations

import json
import os

from loco_jax import hlo
from loco_jax.training.progress import ProgressLine


def emit(line):
    print(line, flush=True)


class Progress:
    """The loop's progress: ``[####....] step/total text`` in place on a terminal
    (:class:`~loco_jax.training.progress.ProgressLine`); elsewhere nothing, as the loop logs each row."""

    def __init__(self, total):
        self.total, self.line = total, ProgressLine(width=30, every_s=None)

    @property
    def tty(self):
        return self.line.tty

    def update(self, step, text):
        self.line.show(step / self.total, f"{step}/{self.total} {text}")

    def close(self):
        self.line.close()



TENSORBOARD_DIR = "tensorboard"


class ScalarWriter:
    """Each metrics row as TensorBoard scalars in ``WORKDIR/tensorboard`` (tensorboardX event files), so
    ``tensorboard --logdir WORKDIR`` shows the loss and eval curves, the learning rate and the bytes sent
    beside ``metrics.jsonl``. A resumed run starts a new event file with ``purge_step`` at its first step,
    so TensorBoard drops the points of the interrupted run after its checkpoint (they are logged again)."""

    def __init__(self, workdir, first_step: int | None = None):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR), purge_step=first_step)

    def write(self, row):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, row["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


def metrics_path(workdir):
    return os.path.join(workdir, "metrics.jsonl")


def read_metrics(workdir):
    path = metrics_path(workdir)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a kill: the rows after the checkpoint are logged again
    return rows


def write_atomic(path, text):
    """Writes ``text`` to ``path`` through a temporary file and a rename: a kill leaves old or new, never half."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def truncate_metrics(workdir, last_step):
    """Drops metric rows logged after the checkpoint we resume from (they will be logged again)."""
    rows = [r for r in read_metrics(workdir) if r.get("step", 0) <= last_step]
    write_atomic(metrics_path(workdir), "".join(json.dumps(r) + "\n" for r in rows))


def summary_table(workdir) -> str:
    """The eval rows of a run as a small text table (printed at the end of a run)."""
    rows = [r for r in read_metrics(workdir) if "eval_loss" in r]
    lines = ["  step   train loss   eval loss   bytes sent / device", "  ----   ----------   ---------   -------------------"]
    for r in rows:
        train = f"{r['loss']:10.3f}" if "loss" in r else " " * 10
        sent = hlo.human_bytes(r["bytes_sent_per_device"]) if "bytes_sent_per_device" in r else ""
        lines.append(f"  {r['step']:4d}   {train}   {r['eval_loss']:9.3f}   {sent:>19}")
    return "\n".join(lines)


def plot(workdir, out=None):
    """Writes ``loss.png``: train and eval loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(workdir)
    out = out or os.path.join(workdir, "loss.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss (global params)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(os.path.basename(os.path.abspath(workdir)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out

