"""Shared set-up for the benchmark scripts: 8 simulated CPU devices, and writing docs/results.md.

Import this module before jax: it sets ``XLA_FLAGS`` for 8 host devices.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shlex
import sys
import time

_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

_HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(_HERE)
# A script run from benchmarks/ has this folder as sys.path[0], where compression.py would shadow
# the standard library's `compression` package that jax imports: take the folder off the path.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "docs", "results.md")


def human(n: float) -> str:
    """Bytes in binary units: 6144 -> '6.00 KiB' (the library's formatter)."""
    from loco_jax.hlo import human_bytes

    return human_bytes(n)


def cpu_model() -> str:
    """The processor's name; ``platform.processor()`` is empty (or just the architecture) on many Linux systems."""
    name = platform.processor()
    if name and name != platform.machine():
        return name
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return name or "unknown processor"


def load_average() -> str:
    """The 1-minute load average ('7.4'), or 'n/a' where the system has none."""
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except (AttributeError, OSError):
        return "n/a"


def start():
    """The start of a run, for ``write_section(..., started=start())``: (clock, load average)."""
    return time.perf_counter(), load_average()


def machine() -> str:
    import jax

    return (
        f"{cpu_model()} ({platform.machine()}), {os.cpu_count()} cores, {platform.system()}, "
        f"Python {platform.python_version()}, jax {jax.__version__} ({jax.device_count()} {jax.default_backend()} devices)"
    )


def command(script: str, extra_args) -> str:
    rel = os.path.relpath(os.path.abspath(script), ROOT)
    return "python " + " ".join([rel] + [shlex.quote(a) for a in extra_args])


def write_section(heading: str, body: str, *, extra_args=(), script=None, path=RESULTS, started=None):
    """Replaces (or appends) the section ``heading`` of docs/results.md; other sections are kept.

    ``started`` (from :func:`start`) adds the run's duration and the load average at its start.
    """
    script = script or sys.argv[0]
    took, load = "", load_average()
    if started is not None:
        took = f" ({time.perf_counter() - started[0]:.0f} s)"
        load = f"{started[1]} at the start, {load} at the end"
    stamp = (
        f"Command: `{command(script, extra_args)}`{took}  \n"
        f"Machine: {machine()}  \n"
        f"Date: {datetime.date.today().isoformat()}; 1-minute load average {load}\n"
    )
    section = f"{heading}\n\n{stamp}\n{body.rstrip()}\n"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    text = open(path).read() if os.path.exists(path) else "# Results\n\nEvery figure here was produced by the command above it.\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text)
    else:
        text = text.rstrip() + "\n\n" + section
    with open(path, "w") as f:
        f.write(text.rstrip() + "\n")


def report(heading: str, text: str, *, no_write: bool, extra_args=(), **kwargs):
    """Prints a benchmark's tables and, unless ``no_write``, puts them into docs/results.md."""
    print(text)
    if not no_write:
        write_section(heading, text, extra_args=extra_args, **kwargs)
