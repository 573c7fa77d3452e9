"""Every shipped config runs the settings its docstring documents (and was measured at, where it says so)."""

import ast
import pathlib

import pytest

from loco_jax.training.run import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.py"))


def documented_settings(path) -> list[str]:
    """The ``key=value`` words of the docstring's ``Settings:`` block (its indented lines after the heading)."""
    doc = ast.get_docstring(ast.parse(pathlib.Path(path).read_text()))
    lines = doc.splitlines()
    assert "Settings:" in lines, f"{path}: its docstring has no 'Settings:' block"
    block = []
    for line in lines[lines.index("Settings:") + 1:]:
        if not line.startswith("    "):
            break
        block += line.split()
    return block


def _value(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def mismatches(path) -> list[str]:
    """Documented settings that ``get_config()`` does not set, as 'documented, set' lines."""
    cfg = config_lib.load(str(path))
    settings = documented_settings(path)
    documented = config_lib.override(config_lib.Config(), settings)  # parsed with each field's own type
    out = []
    for item in settings:
        key = item.split("=", 1)[0]
        if _value(cfg, key) != _value(documented, key):
            out.append(f"docstring {item}, get_config() {key}={_value(cfg, key)!r}")
    return out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_runs_the_settings_its_docstring_documents(path):
    assert len(documented_settings(path)) >= 5
    assert mismatches(path) == [], path.name


def test_a_documented_value_the_config_does_not_set_is_caught(tmp_path):
    source = (ROOT / "configs" / "streaming_diloco.py").read_text()
    assert source.count("diloco.alpha=0.0") == 1
    edited = tmp_path / "edited.py"
    edited.write_text(source.replace("diloco.alpha=0.0", "diloco.alpha=0.5"))
    assert mismatches(edited) == ["docstring diloco.alpha=0.5, get_config() diloco.alpha=0.0"]


def test_the_config_model_fields_are_the_models_own():
    """The config's model section is model.ModelConfig's fields (one description): a field set in a config
    reaches the model, and a run saved before the config had a field resumes at the value it ran with."""
    import dataclasses

    from loco_jax.training import model as model_lib
    from loco_jax.training.run import steps

    model_fields = {f.name: f.type for f in dataclasses.fields(model_lib.ModelConfig)}
    config_fields = {f.name: f.type for f in dataclasses.fields(config_lib.ModelFields)}
    assert config_fields.pop("attention") is str
    assert set(config_fields) == set(model_fields) - {"attention_impl"}
    tiny = ROOT / "configs" / "tiny.py"
    cfg = config_lib.load(tiny, ["model.rope_theta=500000", "model.init_std=0.01", "model.num_kv_heads=2"])
    m = steps.model_config(cfg)
    assert (m.rope_theta, m.init_std, m.num_kv_heads, m.d_model) == (500000.0, 0.01, 2, cfg.model.d_model)
    current = config_lib.to_dict(config_lib.load(tiny))
    saved = config_lib.to_dict(config_lib.load(tiny))
    for name in ("rope_theta", "norm_eps", "param_dtype", "init_std"):
        del saved["model"][name]
    assert config_lib.with_reference_fields(saved)["model"]["rope_theta"] == 10000.0
    assert config_lib.changed_fields(config_lib.with_reference_fields(saved), current) == []
