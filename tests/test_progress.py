"""The application's one progress display (loco_jax.training.progress), as the loop and prepare_data.py use it."""

import io

from loco_jax.training import progress
from loco_jax.training.run import metrics


class _Stream(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self._tty = tty

    def isatty(self):
        return self._tty


def test_a_terminal_gets_one_line_rewritten_in_place_and_ended_once():
    out = _Stream(True)
    line = progress.ProgressLine(out, width=10)
    line.show(0.5, "half")
    line.show(1.0, "done", final=True)
    line.close()  # already ended by the final show: no second newline
    assert out.getvalue() == "\r[#####.....] half   \r[##########] done   \n"


def test_off_a_terminal_plain_lines_are_throttled_or_absent():
    out = _Stream(False)
    line = progress.ProgressLine(out, every_s=3600)
    for i in range(5):
        line.show(i / 5, f"row {i}")
    line.show(1.0, "last", final=True)
    assert out.getvalue() == "row 0\nlast\n"
    quiet = _Stream(False)
    silent = progress.ProgressLine(quiet, every_s=None)  # the loop: it logs its own lines off a terminal
    silent.show(0.5, "x", final=True)
    assert quiet.getvalue() == ""


def test_the_loops_progress_counts_steps(monkeypatch):
    out = _Stream(True)
    monkeypatch.setattr("sys.stderr", out)
    p = metrics.Progress(4)
    p.update(2, "loss 1.000")
    p.close()
    assert out.getvalue() == "\r[###############...............] 2/4 loss 1.000   \n"
    assert progress.hms(59) == "0:59" and progress.hms(3725) == "1:02:05"
