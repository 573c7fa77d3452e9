"""``train_and_evaluate(config, workdir)``: the training loop of a whole experiment.

- the mesh ``(replica, data)`` from ``config.mesh`` (:mod:`loco_jax.training.run.mesh`);
- the inner optimizer: ``loco.compress`` on ``data`` (``config.loco.bits``; ``None`` is the exact fp32
  mean), gradient clipping, AdamW with linear warm-up and cosine decay; wrapped in ``diloco.diloco`` on
  ``replica`` when ``config.diloco.enabled`` (one compiled program per DiLoCo phase, picked in the
  Python loop with ``tx.phase(step)``), else plain data parallel (:mod:`loco_jax.training.run.steps`);
- evaluation on the global parameters (DiLoCo) or the parameters (DP);
- metrics as JSON lines, a progress line, a loss plot (:mod:`loco_jax.training.run.metrics`);
- orbax checkpoints split into global, per-replica and per-device items, resumed bit-identically by
  rerunning the same command in the same workdir (:mod:`loco_jax.training.run.checkpoints`).

Workdir contents: ``config.json`` (the resolved config), ``metrics.jsonl``, ``checkpoints/<step>/``,
``loss.png``, ``programs.json`` (bytes each compiled program moves, from ``hlo.collective_bytes``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import signal
import socket
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from loco_jax.checks import require_int
from loco_jax.training import model as model_lib
from loco_jax.training.run import config as config_lib
from loco_jax.training.run import failure
from loco_jax.training.run import mesh as mesh_lib
from loco_jax.training.run.checkpoints import (
    check_resume_config, checkpoint_manager, complete_checkpoint_steps, restore_step, save, saved_config,
)
from loco_jax.training.run.metrics import (
    Progress, ScalarWriter, emit, metrics_path, plot, read_metrics, summary_table, truncate_metrics, write_atomic,
)
from loco_jax.training.run.sample import print_samples
from loco_jax.training.run.steps import TrainState

PROFILE_DIR = "profile"
from loco_jax.training.run.trainer import Trainer


class _Stop:
    """SIGTERM: finish the current step, write a checkpoint, exit 0."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        self.requested = True



def train_and_evaluate(cfg: config_lib.Config, workdir: str, log=emit, stop_after: int | None = None,
                       step_timeout: float | None = None, verbose: bool = False,
                       profile_steps: int | None = None) -> dict:
    """Trains ``cfg`` in ``workdir`` (resuming from its latest checkpoint); returns a summary.

    ``stop_after``: checkpoint after that step and return, as a pre-emption would (tests, schedulers).
    ``step_timeout``: seconds within which each sync step must complete, else the process reports where
    it is stuck and exits (:class:`~loco_jax.training.run.failure.StepWatchdog`); None: no watchdog. In a
    multi-process run an error saying another process is gone ends this one at once with one message
    (:mod:`loco_jax.training.run.failure`; ``verbose`` prints the full error too). ``profile_steps``: a
    ``jax.profiler`` trace of that many steps after this run's first (which compiles), in
    ``WORKDIR/profile`` (process 0).
    """
    config_lib.validate(cfg)
    require_int("profile_steps", profile_steps, "a positive number of steps, or None", allow_none=True)
    if step_timeout is not None and not (isinstance(step_timeout, (int, float)) and step_timeout > 0):
        raise ValueError(f"step_timeout={step_timeout!r} must be a positive number of seconds (or None: no watchdog).")
    os.makedirs(workdir, exist_ok=True)
    guard = failure.Guard(workdir, jax.process_index(), jax.process_count(), verbose=verbose)
    with workdir_lock(workdir):
        watchdog = failure.StepWatchdog(step_timeout, guard) if step_timeout else None  # started by the loop
        try:
            return _train_and_evaluate(cfg, workdir, log, stop_after, watchdog, guard, profile_steps)
        except Exception as e:
            _stop_if_a_peer_failed(guard, e)
            raise


def _stop_if_a_peer_failed(guard, error):
    """A multi-process run whose error says another process is gone stops here (does not return)."""
    if jax.process_count() > 1 and failure.is_peer_failure(error):
        guard.peer_failed(error)


@contextlib.contextmanager
def workdir_lock(workdir):
    """Holds ``workdir/.lock-p<process index>`` (an exclusive ``flock``) while a run lives in ``workdir``.

    A second run started in the same workdir (a requeued job while the first still runs) would resume from
    the first's checkpoint, rewrite ``metrics.jsonl`` under it (the first's later rows would go to the
    unlinked file and be lost) and save checkpoints over its: it is refused by name instead. The kernel
    drops the lock when the process ends, kill -9 included, so no stale lock outlives a run. One lock per
    process index, as the processes of one multi-process run may share a workdir."""
    name = f".lock-p{jax.process_index()}"
    path = os.path.join(workdir, name)
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise RuntimeError(
                f"workdir {workdir!r} is in use by another run ({holder}); two runs in one workdir would "
                "overwrite each other's checkpoints and metrics. Wait for that run to end, stop it, or pass "
                "another --workdir.") from None
        # the holder may have removed the file between our open and our flock (see below): lock the live one
        try:
            live = os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            live = False
        if live:
            break
        f.close()
    try:
        f.truncate(0)
        f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        f.flush()
        yield
    finally:
        # a run refused before it wrote anything (a bad setting) leaves the workdir as it found it
        if os.listdir(workdir) == [name]:
            os.unlink(path)
        fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def _train_and_evaluate(cfg, workdir, log, stop_after, watchdog, guard, profile_steps=None):
    saved = saved_config(workdir)
    cfg = config_lib.resolve(cfg, saved)  # None settings: the run's own, else the library's
    done = complete_checkpoint_steps(workdir)  # read from disk: a fresh workdir stays untouched
    if done and done[-1] >= cfg.steps:
        check_resume_config(workdir, cfg, saved, log=lambda *_: None)  # a changed model is still refused
        return _already_finished(cfg, workdir, done[-1], log)
    check_resume_config(workdir, cfg, saved, log)
    trainer = Trainer(cfg, workdir, log)
    trainer.dataset  # load (or download) the data before anything compiles
    _describe(trainer, log)
    run = _Run(trainer, workdir, log, watchdog, stop_after, profile_steps)
    # what a sync step does, in order: the interval's metrics come to the host in one transfer, then each
    # periodic action whose step it is (the stop agreement and the checkpoint come last: they act on the rest)
    sync_actions = (run.read, run.log_row, run.evaluate, run.write_row, run.agree_stop, run.checkpoint)
    with run.live(guard):
        for step in range(run.start + 1, cfg.steps + 1):
            run.step(step)
            if not run.is_sync(step):
                continue  # a quiet step: no device read, no host collective
            for action in sync_actions:
                action(step)
            if watchdog:
                watchdog.synced()
            if run.stop.requested:
                log(f"stop requested: checkpoint written at step {step}; exiting")
                break
    return run.finish()


def _describe(trainer, log):
    cfg = trainer.cfg
    log(f"{mesh_lib.describe(trainer.mesh)}; model {model_lib.count_params(trainer.mcfg):,} parameters; "
        f"{trainer.strategy.name}, loco bits={cfg.loco.bits}")
    if cfg.optim.warmup_steps >= cfg.steps:
        log(f"warning: optim.warmup_steps={cfg.optim.warmup_steps} >= steps={cfg.steps}; the warm-up is shortened to "
            f"{max(cfg.steps - 1, 0)} step(s) so the learning rate still reaches its peak and decays")


class _Run:
    """One run of the loop: the state its step and its periodic actions read and advance.

    Built from the latest checkpoint in the workdir (or a fresh init); :meth:`step` dispatches one step
    program; at a sync step (:meth:`is_sync`) the loop calls the actions :meth:`read`, :meth:`log_row`,
    :meth:`evaluate`, :meth:`write_row`, :meth:`agree_stop` and :meth:`checkpoint`, each of which acts only
    at its own period. :meth:`live` holds the run's open files and handlers; :meth:`finish` writes the
    summary and returns it.
    """

    def __init__(self, trainer, workdir, log, watchdog, stop_after, profile_steps):
        cfg = self.cfg = trainer.cfg
        self.trainer, self.workdir, self.log = trainer, workdir, log
        self.watchdog, self.stop_after = watchdog, stop_after
        self.is_main = jax.process_index() == 0
        self.manager = checkpoint_manager(workdir, cfg.keep_checkpoints)
        self.start, data_state, self.bytes_so_far, meta = 0, None, 0.0, {}
        self.resumed = self.manager.latest_step() is not None
        if self.resumed:
            self.state, meta = restore_step(self.manager, self.manager.latest_step(), trainer, log)
            self.start, data_state, self.bytes_so_far = meta["step"], meta["data"], meta.get("bytes_sent", 0.0)
            log(f"resumed from checkpoint at step {self.start}")
        else:
            self.state = trainer.init_state()
        self.batches = trainer.dataset.train_iterator(seed=cfg.data.seed, state=data_state)
        check_replicas_identical(trainer, self.state, resumed=self.resumed)
        if self.is_main:  # written once the start is known to be sound: a refused resume leaves the workdir as it was
            write_atomic(os.path.join(workdir, "config.json"), config_lib.dumps(cfg))
            truncate_metrics(workdir, self.start)  # rows logged after the checkpoint (or with none) come again
        # Reads at the start are fine: the loop reads the device only at sync steps.
        self.counts_seen = trainer.skipped(self.state)
        self.offset = trainer.strategy.schedule_offset(self.state, self.start) if self.resumed else 0
        self.window = StepWindow(cfg.batch_size * cfg.seq_len, trainer.read_steps, self.counts_seen)
        if self.resumed:  # the steps since the last log row, read when the checkpoint was written
            self.window.carry_unlogged(meta.get("unlogged", []))
        self.profile = _Profile(self.start, profile_steps, workdir, log) if profile_steps and self.is_main else None
        self.at = watchdog.at if watchdog else lambda step, phase: None
        self.stop, self.eval_loss, self.last_saved, self.row = _Stop(), None, self.start, None

    def due(self, step, every):
        return step % every == 0 or step == self.cfg.steps

    def is_sync(self, step):
        cfg = self.cfg
        return (self.due(step, cfg.log_every) or self.due(step, cfg.eval_every) or self.due(step, cfg.checkpoint_every)
                or step == self.stop_after)

    @contextlib.contextmanager
    def live(self, guard):
        """The run's SIGTERM handler, metrics files, watchdog and checkpoint manager, closed whatever happens."""
        try:
            previous = signal.signal(signal.SIGTERM, self.stop)
        except ValueError:  # not the main thread: no SIGTERM handling
            previous = None
        self.progress = Progress(self.cfg.steps)
        self.metrics_file = open(metrics_path(self.workdir), "a") if self.is_main else None
        self.scalars = (ScalarWriter(self.workdir, first_step=self.start + 1 if self.resumed else None)
                        if self.is_main else None)
        if self.watchdog:
            self.trainer.compiling = self.watchdog.paused  # compiling a new phase's program is local work, not a hang
            self.watchdog.start()
        try:
            self.batch = (self.trainer.put_batch(self.batches.next_batch(self.cfg.batch_size))
                          if self.start < self.cfg.steps else None)
            yield
        except Exception as e:  # before the clean-up below, which would wait on a dead peer's barriers
            _stop_if_a_peer_failed(guard, e)
            raise
        finally:
            if self.watchdog:
                self.watchdog.stop()  # the end of the run (summary, samples) is not a step
            self.progress.close()
            if self.metrics_file:
                self.metrics_file.close()
                self.scalars.close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            self.manager.close()

    def step(self, step):
        """Dispatches step ``step``'s program (not awaited) and sends the next batch while it runs."""
        trainer, cfg = self.trainer, self.cfg
        self.at(step, "running the step program")
        if self.profile:
            self.profile.before(step)
        phase = trainer.phase(step - self.offset)
        prog = trainer.program(phase, self.state, self.batch)
        params, opt_state, out = prog(self.state.params, self.state.opt_state, *self.batch)
        self.state = TrainState(params, opt_state)
        self.window.add(step, out)
        self.data_position = self.batches.state()  # after this step's batch: what a checkpoint here records
        if step < cfg.steps:  # the next batch is cut and sent while this step runs
            self.batch = trainer.put_batch(self.batches.next_batch(cfg.batch_size))
        if jax.default_backend() == "cpu":
            # XLA's CPU collectives can deadlock with several multi-device programs in flight.
            jax.block_until_ready(self.state)
        self.bytes_so_far += trainer.program_bytes[str(phase)]["per_device"]
        if self.profile:
            self.profile.after(step, self.state)

    def read(self, step):
        """The interval's per-step outputs to the host; every non-finite step since the last read reported
        (or, under ``nonfinite='stop'``, raised)."""
        self.at(step, "reading the step's metrics (waits for the device)")
        self.window.read()
        for bad, what in self.window.new_faults(self.counts_seen, lambda t: self.trainer.phase(t - self.offset)):
            if self.cfg.nonfinite == "stop":
                raise FloatingPointError(
                    f"non-finite gradients or outer gradients at step {bad} (nonfinite='stop'): {what}. "
                    "Set nonfinite='skip' to skip such steps and go on."
                )
            self.log(f"warning: step {bad}: {what}")
        self.counts_seen = self.window.counts
        self.row = None

    def log_row(self, step):
        if not self.due(step, self.cfg.log_every):
            return
        row = self.window.log_row(step, self.trainer, self.bytes_so_far)
        if not math.isfinite(row["loss"]) and self.cfg.nonfinite == "stop":
            raise FloatingPointError(f"non-finite loss {row['loss']} at step {self.window.first_nonfinite_loss} "
                                     "(nonfinite='stop').")
        error_rms = self.trainer.loco_error_rms(self.state)
        if error_rms is not None:
            row["loco_error_rms"] = error_rms
            row["loco_error_to_grad"] = error_rms / max(row["grad_rms"], 1e-30)
        self.row = row

    def evaluate(self, step):
        if not self.due(step, self.cfg.eval_every):
            return
        self.at(step, "evaluation")
        self.eval_loss = self.trainer.evaluate(self.state)
        self.row = dict(self.row or {"step": step}, eval_loss=self.eval_loss)

    def write_row(self, step):
        """The row to ``metrics.jsonl`` and TensorBoard (process 0), and the progress line."""
        row, eval_loss = self.row, self.eval_loss
        if row is None:
            return
        if self.metrics_file:
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
            self.scalars.write(row)
        evaluated = f" eval {eval_loss:.3f}" if eval_loss else ""
        self.progress.update(step, f"loss {row.get('loss', float('nan')):.3f}" + evaluated)
        if not self.progress.tty:
            self.log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))

    def agree_stop(self, step):
        """A stop requested on any process (SIGTERM) stops every process at this same step."""
        if jax.process_count() > 1:  # agreed only here, at a step that synchronises anyway
            from jax.experimental import multihost_utils

            self.at(step, "agreeing on a stop request with the other processes")
            self.stop.requested = bool(np.any(multihost_utils.process_allgather(np.array(self.stop.requested))))
        if self.stop_after is not None and step >= self.stop_after:
            self.stop.requested = True  # the same step on every process: no agreement needed

    def checkpoint(self, step):
        if not (self.due(step, self.cfg.checkpoint_every) or self.stop.requested):
            return
        self.at(step, "writing a checkpoint")
        trainer = self.trainer
        mesh = {"replica": trainer.m, "data": trainer.d, "fsdp": self.cfg.mesh.fsdp, "local": self.cfg.mesh.local}
        save(self.manager, step, trainer, self.state, {"step": step, "data": self.data_position,
                                                       "bytes_sent": self.bytes_so_far, "mesh": mesh,
                                                       "unlogged": self.window.host})
        self.last_saved = step

    def finish(self) -> dict:
        """The end of a run: ``programs.json``, the summary table and plot (process 0), samples; the summary."""
        workdir, log = self.workdir, self.log
        if self.is_main:
            with open(os.path.join(workdir, "programs.json"), "w") as f:
                json.dump(self.trainer.program_bytes, f, indent=2)
            log(summary_table(workdir))
            log(f"loss plot: {plot(workdir)}; metrics: {metrics_path(workdir)}")
        if self.cfg.sample_tokens and not self.stop.requested:  # every process: a sharded leaf is gathered together
            print_samples(self.trainer, self.state, log, step=self.last_saved, length=self.cfg.sample_tokens)
        return {"last_step": self.last_saved, "eval_loss": self.eval_loss, "stopped": self.stop.requested,
                "state": self.state}


class _Profile:
    """A ``jax.profiler`` trace of ``steps`` steps after a run's first (which compiles), in ``WORKDIR/profile``."""

    def __init__(self, start, steps, workdir, log):
        self.first, self.last = start + 2, start + 1 + steps
        self.dir, self.log = os.path.join(workdir, PROFILE_DIR), log

    def before(self, step):
        if step == self.first:
            jax.profiler.start_trace(self.dir)

    def after(self, step, state):
        if step == self.last:
            jax.block_until_ready(state)
            jax.profiler.stop_trace()
            self.log(f"profile of steps {self.first}-{self.last}: {self.dir} "
                     "(tensorboard --logdir WORKDIR, Profile tab; or https://ui.perfetto.dev)")


def _already_finished(cfg, workdir, latest, log):
    """A rerun of a run whose latest checkpoint is at or past ``cfg.steps``: nothing is trained or written."""
    where = "at" if latest == cfg.steps else f"past steps={cfg.steps}, at"
    log(f"the run in {workdir} is already {where} step {latest}: nothing to train. Raise steps to extend it "
        f"(--set steps=N, N > {latest}); `python train.py --workdir {workdir} --sample` prints text from its "
        "checkpoint.")
    evals = [r["eval_loss"] for r in read_metrics(workdir) if "eval_loss" in r]
    if jax.process_index() == 0 and evals:
        log(summary_table(workdir))
    return {"last_step": latest, "eval_loss": evals[-1] if evals else None, "stopped": False, "state": None}


def read_on_host(outs):
    """:meth:`Trainer.read_steps` for outputs that need no cross-replica program (one replica's, or host
    values): the same rows, computed with NumPy."""
    got = jax.device_get(outs)
    rows = {"loss": np.array([np.mean(o["loss"]) for o in got]),
            "grad_rms": np.array([np.mean(o["grad_rms"]) for o in got]),
            "skipped": np.array([np.atleast_1d(o["skipped"]) for o in got])}
    if got and "dropped" in got[0]:
        rows["dropped"] = np.array([o["dropped"] for o in got])
    return rows


class StepWindow:
    """The per-step outputs (loss, gradient RMS, skip counts) since the last sync step, kept on device.

    ``read()`` brings every step read since the last sync step to the host with ``read_steps``
    (:meth:`~loco_jax.training.run.trainer.Trainer.read_steps`: one program and one transfer, the mean of each
    step's per-replica loss and gradient RMS over the replicas, and every replica's skip counts); a log row
    averages every step since the previous log row (the logged loss is the interval's mean, not one
    step's). A checkpoint records the steps read but not yet logged (``meta["unlogged"]``), so a resumed
    run logs the same means.
    """

    def __init__(self, tokens_per_step, read_steps=read_on_host, counts=None):
        self.tokens_per_step, self.read_steps = tokens_per_step, read_steps
        self.on_device, self.host = [], []  # (step, out) not yet read; read but not yet logged
        # the latest skip counts read: per-replica skipped steps, dropped outer rounds (Trainer.skipped)
        self.counts = counts or {"skipped": np.zeros(1, int), "dropped": 0}
        self._new = []
        self.t_last = time.perf_counter()
        self.carried = 0  # host rows restored from a checkpoint: logged, but not run in this interval's time

    def carry_unlogged(self, rows):
        """The steps a checkpoint read but did not log: they join the next row's means, not its speed."""
        self.host = [tuple(r) for r in rows]
        self.carried = len(self.host)

    def add(self, step, out):
        self.on_device.append((step, out))

    def read(self):
        if not self.on_device:
            self._new = []
            return
        steps = [s for s, _ in self.on_device]
        rows = self.read_steps([o for _, o in self.on_device])
        self.on_device = []
        dropped = rows.get("dropped", np.zeros(len(steps), int))
        self._new = [(s, {"skipped": np.asarray(rows["skipped"][i]).astype(int), "dropped": int(dropped[i])})
                     for i, s in enumerate(steps)]
        self.host += [(s, float(rows["loss"][i]), float(rows["grad_rms"][i])) for i, s in enumerate(steps)]

    def new_faults(self, seen, phase_of):
        """(step, what happened) for every non-finite step read since the counts ``seen``, oldest first.

        One replica (data parallel): the step was skipped on every device. Several (DiLoCo): each replica
        whose count rose skipped that step alone; a rise of ``dropped`` is the fragment that step sent
        (``phase_of(step).send``), whose round every replica drops.
        """
        out = []
        for step, counts in self._new:
            skipped, dropped = counts["skipped"], counts["dropped"]
            if len(skipped) == 1 and skipped[0] > seen["skipped"][0]:
                out.append((step, f"non-finite values; the step was skipped on every device "
                                  f"({skipped[0]} skipped so far)"))
            elif len(skipped) > 1:
                for r in np.flatnonzero(skipped > seen["skipped"]):
                    out.append((step, f"non-finite values on replica {r}: that replica skipped the step and the "
                                      f"others went on ({skipped[r]} skipped so far on replica {r})"))
            if dropped > seen["dropped"]:
                p = phase_of(step).send
                out.append((step, f"the exchanged outer gradient of fragment {p} was non-finite (a replica sent "
                                  f"NaN or Inf): every replica drops this round of fragment {p}, which syncs again "
                                  f"at its next turn ({dropped} rounds dropped so far)"))
            seen = counts
        self.counts = seen
        return out

    @property
    def first_nonfinite_loss(self):
        return next((s for s, loss, _ in self.host if not math.isfinite(loss)), None)

    def log_row(self, step, trainer, bytes_so_far):
        now = time.perf_counter()
        losses = [loss for _, loss, _ in self.host]
        grad_rms = [g for _, _, g in self.host]
        skipped = self.counts["skipped"]
        row = {
            # the optimizer's own count: skipped steps do not advance the learning-rate schedule (each
            # replica's own under DiLoCo; their mean)
            "step": step, "loss": sum(losses) / len(losses),
            "lr": float(np.mean([trainer.schedule(step - 1 - int(n)) for n in skipped])),
            "tokens_per_s": self.tokens_per_step * (len(self.host) - self.carried) / (now - self.t_last),
            "bytes_sent_per_device": bytes_so_far, "skipped_steps": int(skipped.sum()),
            "grad_rms": sum(grad_rms) / len(grad_rms),
        }
        row.update(trainer.strategy.log_fields(self.counts))
        self.host, self.t_last, self.carried = [], now, 0
        return row


def check_replicas_identical(trainer, state, resumed):
    """Every replica must hold the same starting point: refuse to train otherwise.

    A fresh run compares the local parameters (each replica's block); a resumed
    one compares every device's copy of the global parameters (local ones
    differ between syncs by design). The largest max - min over ``replica``, on device
    (:func:`replica_gap`).
    """
    compared = trainer.strategy.compared_params(state, resumed, trainer.param_specs, trainer.global_param_specs)
    if compared is None or trainer.m == 1:
        return
    tree, spec = compared
    fn = jax.jit(jax.shard_map(replica_gap, mesh=trainer.mesh, in_specs=(spec,), out_specs=P(), check_vma=False))
    gap = float(fn(tree))
    if gap != 0.0:
        what = "global" if resumed else "initial"
        raise RuntimeError(f"replicas hold different {what} parameters (max difference {gap:g}); refusing to train.")


def replica_gap(tree):
    """Inside ``shard_map``: the largest ``max - min`` over ``replica`` of any value of ``tree``, over every
    device. Exact (a pmean of identical values rounds for most replica counts).

    One ``pmax`` over ``replica`` per leaf, of ``[x, -x]`` (its max and minus its min at once), each fed
    through an optimization barrier with the running gap so every collective follows the one before
    (:func:`loco_jax.hlo.unordered_collectives` finds no pair: the old per-leaf ``pmax`` and ``pmin`` were
    independent). The max over
    ``data`` covers FSDP, where each data device compares its own shard."""
    gap = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        x, gap = lax.optimization_barrier((x, gap))
        extremes = lax.pmax(jnp.stack([x, -x]).astype(jnp.float32), "replica")
        gap = jnp.maximum(gap, jnp.max(extremes[0] + extremes[1]))
    return lax.pmax(gap, "data")
