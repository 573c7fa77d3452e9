"""How a run goes down when it cannot go on: a peer process that died, or a step that never finishes.

Two ways a multi-process run stops making progress, and what each does here:

- **A peer process failed.** A collective with a dead peer raises at once on gloo (``Connection reset
  by peer``): the loop hands the error to :meth:`Guard.peer_failed`, which prints one message (the
  process, the latest complete checkpoint, the command that resumes), writes the full error to
  ``<workdir>/failure-p<i>.log`` and leaves with :data:`EXIT_PEER_FAILED`, without jax.distributed's
  shutdown barrier (which would wait ``shutdown_timeout`` for the dead peer and then abort). Where no
  collective raises, the coordination service notices the dead process after ``--heartbeat-timeout``
  seconds (at once if it was the coordinator's) and jax's runtime aborts every other process with a C++
  stack trace; :func:`supervise`, the process ``train.py`` keeps above the training one, turns that
  abort into the same message and status.
- **A step hangs.** A peer that is alive but never enters a collective (a stuck host, a wedged NCCL
  communicator) blocks every other process and no heartbeat sees it. :class:`StepWatchdog` counts the
  seconds since the last sync step completed (compiling excluded) and, past ``--step-timeout``, prints
  where the main thread is (step, phase, its Python stack) and leaves with :data:`EXIT_STEP_TIMEOUT`.

Leaving with ``os._exit`` at any point leaves the workdir resumable: orbax writes a checkpoint into a
temporary folder and renames it when complete, ``config.json`` is replaced atomically, and a metric row
cut short is skipped when read and logged again after the resume (the same guarantees that let
``kill -9`` land anywhere; ``tests/test_trainer.py`` kills at random points). Rerunning the same command
on every process resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
import threading
import time
import traceback

from loco_jax.training.run.checkpoints import complete_checkpoint_steps

EXIT_PEER_FAILED = 75  # EX_TEMPFAIL: a retry (the same command, once every process is back) resumes
EXIT_STEP_TIMEOUT = 124  # timeout(1)'s status: no sync step completed within --step-timeout

# Substrings of the errors a collective or the coordination service raises when another process is gone
# (gloo raises ValueError or JaxRuntimeError, orbax's barriers TimeoutError: the text decides, not the type).
_PEER_MARKERS = (
    "connection closed by peer", "connection reset by peer", "heartbeat timeout", "barrier failed",
    "task is set to error", "stopped sending heartbeats", "failed to send rpc to coordination service",
    "nccl error", "socket closed", "broken pipe",
)


def is_peer_failure(error: BaseException) -> bool:
    """True for an error that says another process of a multi-process run is gone or unreachable."""
    if isinstance(error, PeerFailedError):
        return True
    text = str(error).lower()
    return any(marker in text for marker in _PEER_MARKERS) or ("gloo" in text and "failed" in text)


class PeerFailedError(RuntimeError):
    """Raised where a peer failure is detected outside a jax call."""


def resume_command() -> str:
    """The command that started this process (``python train.py ...``): rerunning it resumes."""
    argv = sys.argv if sys.argv and sys.argv[0] else ["train.py"]
    return shlex.join(["python", *argv])


class Guard:
    """The run's way down: one message on stderr, the details in ``<workdir>/failure-p<i>.log``, ``os._exit``.

    ``verbose``: print the full error and stacks to stderr too.
    """

    def __init__(self, workdir: str | None, process_index: int = 0, process_count: int = 1, verbose: bool = False,
                 command: str | None = None):
        self.workdir, self.process_index, self.process_count = workdir, process_index, process_count
        self.verbose, self.command = verbose, command or resume_command()
        self._lock = threading.Lock()

    def _exit(self, headline: str, detail: str, code: int, show_detail: bool = False):
        with self._lock:  # a second report (the watchdog and the main thread at once) waits here
            self.report(headline, detail, show_detail)
            # not sys.exit: jax.distributed's atexit shutdown would wait for the dead peer, then abort
            os._exit(code)

    @property
    def log_path(self) -> str | None:
        return os.path.join(self.workdir, f"failure-p{self.process_index}.log") if self.workdir else None

    def report(self, headline: str, detail: str, show_detail: bool = False):
        """Prints the message (where the run stands, how to resume) and appends ``detail`` to the log file."""
        log_path = self.log_path
        if log_path:
            with contextlib.suppress(OSError), open(log_path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {headline}\n{detail}\n")
        steps = complete_checkpoint_steps(self.workdir) if self.workdir else []
        where = (f"the latest complete checkpoint is at step {steps[-1]}" if steps
                 else "there is no complete checkpoint yet (a rerun starts from step 0)")
        every = " on every process" if self.process_count > 1 else ""
        lines = [f"process {self.process_index}: {headline}", f"  {where}; to resume, rerun{every}: {self.command}"]
        if log_path:
            lines.append(f"  details: {log_path}" + ("" if self.verbose or show_detail else
                                                     " (--verbose prints them here)"))
        if self.verbose or show_detail:
            lines.append(detail)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()

    def peer_failed(self, error) -> None:
        """Another process is gone: report and leave with :data:`EXIT_PEER_FAILED`. Does not return."""
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        detail = "".join(traceback.format_exception(error)) if isinstance(error, BaseException) else str(error)
        self._exit(f"a peer process failed, stopping ({first[:300]})", detail, EXIT_PEER_FAILED)

    def step_timed_out(self, seconds: float, step: int, phase: str, stack: str) -> None:
        """No sync step completed in time: report where the main thread is, leave with :data:`EXIT_STEP_TIMEOUT`."""
        headline = (f"no sync step completed within --step-timeout={seconds:g} s; stuck at step {step} "
                    f"({phase}), exiting so the job can be restarted")
        # where it hangs is the point here: the stack is printed at every log level
        self._exit(headline, f"main thread stack (most recent call last):\n{stack}", EXIT_STEP_TIMEOUT, show_detail=True)


class StepWatchdog:
    """A daemon thread that ends the process when no sync step completes within ``timeout`` seconds.

    The loop marks where it is (:meth:`at`), resets the clock when a sync step's outputs reach the host
    (:meth:`synced`) and stops the clock while compiling (:meth:`paused`: local work that can take
    minutes at a new phase, not a hang). What it sees: the host waiting on the device (a collective that
    never completes, a device that never returns) and the host itself stuck (I/O, a lock), at sync
    steps, evaluations and checkpoints. What it cannot see: between sync steps the loop only dispatches
    work and reads nothing from the device, so a hang there shows at the next sync step, up to
    ``log_every`` steps later; and a device that is slow but progressing is not a hang.
    """

    def __init__(self, timeout: float, guard: Guard, poll: float | None = None):
        if not timeout > 0:
            raise ValueError(f"--step-timeout={timeout!r} must be a positive number of seconds.")
        self.timeout, self.guard = float(timeout), guard
        self.poll = poll if poll is not None else min(5.0, self.timeout / 10)
        self.step, self.phase = 0, "start-up"
        self._deadline = time.monotonic() + self.timeout
        self._paused = 0
        self._stop = threading.Event()
        self._main = threading.main_thread().ident
        self._thread = threading.Thread(target=self._watch, name="step-watchdog", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()

    def at(self, step: int, phase: str):
        self.step, self.phase = step, phase

    def synced(self):
        self._deadline = time.monotonic() + self.timeout

    @contextlib.contextmanager
    def paused(self):
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self.synced()

    def _watch(self):
        while not self._stop.wait(self.poll):
            if self._paused or time.monotonic() < self._deadline:
                continue
            frame = sys._current_frames().get(self._main)
            stack = "".join(traceback.format_stack(frame)) if frame is not None else "(main thread not found)"
            self.guard.step_timed_out(self.timeout, self.step, self.phase, stack)


# --------------------------------------------------------------------------- the supervising process

SUPERVISED_ENV = "LOCO_JAX_RUNTIME_LOG"  # set in the training process: where its runtime's stderr goes
_SUPERVISOR_ENV = "LOCO_JAX_SUPERVISOR_PID"
# What jax's runtime writes before it aborts a process because the coordination service reports a dead one
_RUNTIME_PEER_MARKERS = ("detected fatal errors", "coordination service", "stopped sending heartbeats",
                         "heartbeat timeout")


def supervise(command: list[str], guard: Guard) -> int:
    """Runs the training process ``command`` and says in one message how it ended; returns its exit status.

    A multi-process run needs this second process because jax's runtime ends a process whose peer died
    by aborting it (a fatal error and a C++ stack trace, after ``--heartbeat-timeout``, or at once when
    the coordinator's process is the one that died) and offers no usable hook in the process itself. The
    training process sends the runtime's own stderr to a file (:func:`runtime_messages_to`); when it
    ends with such an abort, this process prints the peer-failure message of :class:`Guard` and returns
    :data:`EXIT_PEER_FAILED`; the runtime's messages go to ``<workdir>/failure-p<i>.log``. SIGTERM is
    passed on (the training process checkpoints and exits 0); the training process dies with this one
    (:func:`die_with_supervisor`), so killing either ends both, as a dead host would. With ``verbose``
    the runtime writes straight to stderr and an abort is passed on as it is (status 128 + signal).
    """
    import signal
    import subprocess
    import tempfile

    fd, runtime_log = tempfile.mkstemp(prefix=f"loco_jax-p{guard.process_index}-", suffix=".log")
    os.close(fd)
    env = dict(os.environ, **{SUPERVISED_ENV: "-" if guard.verbose else runtime_log, _SUPERVISOR_ENV: str(os.getpid())})
    child = subprocess.Popen(command, env=env)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    try:
        while True:
            try:  # Ctrl-C reaches the training process from the terminal: it stops it; wait for its end here
                status = child.wait()
                break
            except KeyboardInterrupt:
                continue
    finally:
        signal.signal(signal.SIGTERM, previous)
    with open(runtime_log, errors="replace") as f:
        runtime = f.read()
    os.unlink(runtime_log)
    text = runtime.lower()
    if status < 0 and any(marker in text for marker in _RUNTIME_PEER_MARKERS):
        guard.report(f"a peer process failed, stopping (the runtime ended the training process: signal {-status})",
                     f"runtime messages of the training process:\n{runtime}")
        return EXIT_PEER_FAILED
    if status < 0:  # another crash: the runtime's messages are the only account of it
        sys.stderr.write(runtime)
        return 128 - status
    # it ended well, or it said why not (a Python error, a peer failure, a step timeout): keep the runtime's words
    if status and runtime and guard.workdir and os.path.isdir(guard.workdir):
        with contextlib.suppress(OSError), open(guard.log_path, "a") as f:
            f.write(f"runtime messages of the training process (exit status {status}):\n{runtime}\n")
    return status


def die_with_supervisor() -> None:
    """In the training process: die when the supervising process dies (Linux's ``PR_SET_PDEATHSIG``; a
    no-op elsewhere), and at once if it is already gone. Set here rather than between fork and exec,
    which is unsafe in a process with threads."""
    supervisor = os.environ.get(_SUPERVISOR_ENV)
    if not supervisor:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != int(supervisor):  # it died before the line above
        os._exit(EXIT_PEER_FAILED)


def runtime_messages_to(path: str) -> None:
    """In the training process: the runtime's stderr (file descriptor 2: XLA's and jax's C++ logs, fatal
    errors) goes to ``path``; Python's ``sys.stderr`` stays where stderr was (a terminal keeps its
    progress bar). Call before jax starts its backends."""
    terminal = os.dup(2)
    log = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 2)
    os.close(log)
    sys.stderr = os.fdopen(terminal, "w", buffering=1, errors="backslashreplace")
