"""The README's recipe runs as written, and its two commands are what CI runs."""

import pathlib
import re

import numpy as np

from loco_jax import hlo

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_recipe_runs_and_sends_only_uint8_gradient_payloads():
    code = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert np.isfinite(float(scope["loss"]))
    report = hlo.collective_bytes(scope["step"].lower(scope["params"], scope["opt_state"], scope["x"], scope["y"]).compile())
    gradient_sized = [op for op in report.ops if op.bytes_per_device > 1024]
    assert gradient_sized and all(op.dtype == "u8" for op in gradient_sized), report.table()


def test_diloco_snippet_runs():
    code = re.findall(r"```python\n(.*?)```", README, re.S)[1]
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    state, tx = scope["state"], scope["tx"]
    assert int(state.step) == 12 and state.skipped.tolist() == [0, 0] and int(state.dropped) == 0  # one count per replica
    assert [tx.phase(t).apply for t in (7, 9, 11)] == [0, 1, 2]  # every fragment synced once


def test_ci_runs_the_readme_test_command():
    commands = [line.strip() for line in README.splitlines() if line.startswith("    python3 -m venv")]
    assert len(commands) == 2, commands
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()


def test_library_imports_nothing_of_the_training_application():
    import subprocess
    import sys

    library = ["quant", "collectives", "loco", "backward", "diloco", "fragments", "specs", "hlo", "fsdp", "checks"]
    code = ("import sys; import " + ", ".join(f"loco_jax.{m}" for m in library)
            + "; print(sorted(m for m in sys.modules if m.startswith('loco_jax.training')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


def test_layout_section_names_every_module():
    layout = README[README.index("## Layout"):]
    for path in sorted([*(ROOT / "loco_jax").glob("*.py"), *(ROOT / "loco_jax" / "training").glob("*.py")]):
        if path.name != "__init__.py":
            assert f"  {path.name}" in layout or f"/{path.name}" in layout, f"README's layout misses {path}"


def test_the_library_package_exports_the_library_only_and_no_old_application_paths():
    """``loco_jax`` lists its library modules; the application lives in ``loco_jax.training`` alone (the
    old top-level paths ``loco_jax.config``, ``data``, ``mesh``, ``model``, ``trainer`` are gone)."""
    import importlib.util

    library = __import__("loco_jax").__all__
    assert set(library) >= {"quant", "collectives", "loco", "backward", "diloco", "fragments", "fsdp", "hlo", "specs",
                            "nonfinite", "sparse"}
    assert "training" not in library
    for old in ("config", "data", "mesh", "model", "trainer"):
        assert importlib.util.find_spec(f"loco_jax.{old}") is None, old
