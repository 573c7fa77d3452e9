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
    """Bytes in binary units: 6144 -> '6.00 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def machine() -> str:
    import jax

    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} cores, {platform.system()}, Python {platform.python_version()}, jax {jax.__version__} ({jax.default_backend()})"


def command(script: str, extra_args) -> str:
    rel = os.path.relpath(os.path.abspath(script), ROOT)
    return "python " + " ".join([rel] + [shlex.quote(a) for a in extra_args])


def write_section(heading: str, body: str, *, extra_args=(), script=None, path=RESULTS):
    """Replaces (or appends) the section ``heading`` of docs/results.md; other sections are kept."""
    script = script or sys.argv[0]
    stamp = (
        f"Command: `{command(script, extra_args)}`  \n"
        f"Machine: {machine()}  \n"
        f"Date: {datetime.date.today().isoformat()}\n"
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
