"""Per-bit defaults: None settings resolve from the library, config.json records them, old workdirs keep theirs."""

import json
import os

import pytest

from loco_jax.training.run import config as config_lib
from loco_jax import diloco, loco, quant
from loco_jax.training.run.loop import train_and_evaluate
from tests.helpers import quiet, small_config


@pytest.mark.parametrize("bits", [8, 4, 2, 1])
def test_every_default_is_a_valid_setting(bits):
    for lib in (loco, diloco):
        s = lib.settings(bits)
        quant.validate(bits, 256, s["format"], rotate=s["rotate"])
        assert lib.settings(bits, preset="reference") == lib.REFERENCE


def test_given_settings_win_and_none_takes_the_default():
    assert loco.settings(2, format="int")["format"] == "int"
    assert loco.settings(2, beta=0.0)["beta"] == 0.0
    assert loco.settings(2) == loco.MEASURED[2]
    with pytest.raises(ValueError, match="unknown LoCo setting"):
        loco.settings(2, colour="red")


def test_set_bits_alone_gets_the_measured_default():
    cfg = config_lib.resolve(config_lib.override(config_lib.Config(), ["loco.bits=2", "diloco.bits=1"]))
    for name in config_lib.RESOLVED_FIELDS["loco"]:
        assert getattr(cfg.loco, name) == loco.MEASURED[2][name], name
    for name in config_lib.RESOLVED_FIELDS["diloco"]:
        assert getattr(cfg.diloco, name) == diloco.MEASURED[1][name], name
    ref = config_lib.resolve(config_lib.override(config_lib.Config(), ["loco.bits=2", "loco.preset=reference"]))
    assert {n: getattr(ref.loco, n) for n in config_lib.RESOLVED_FIELDS["loco"]} == loco.REFERENCE
    explicit = config_lib.resolve(config_lib.override(config_lib.Config(), ["loco.bits=2", "loco.format=uniform"]))
    assert explicit.loco.format == "uniform"
    assert config_lib.resolve(explicit) == explicit, "resolving a resolved config changes nothing"


def test_a_saved_run_keeps_its_settings_and_an_old_one_its_reference():
    cfg = config_lib.override(config_lib.Config(), ["loco.bits=2"])
    saved = config_lib.to_dict(config_lib.resolve(cfg))
    saved["loco"]["format"] = "uniform"  # what that run was started with
    assert config_lib.resolve(cfg, saved).loco.format == "uniform"
    old = config_lib.to_dict(config_lib.Config())
    for section, names in config_lib.RESOLVED_FIELDS.items():  # an older version recorded neither
        for name in ("format", "rotate", "preset"):
            old[section].pop(name, None)
    old["loco"].update(beta=0.8, compensate=True, compensate_second_stage=False)
    old["diloco"].update(compensate=False)
    resolved = config_lib.resolve(cfg, old)
    assert {n: getattr(resolved.loco, n) for n in config_lib.RESOLVED_FIELDS["loco"]} == loco.REFERENCE
    assert {n: getattr(resolved.diloco, n) for n in config_lib.RESOLVED_FIELDS["diloco"]} == diloco.REFERENCE


def test_config_json_records_the_resolved_settings_and_an_old_workdir_resumes(text_file, tmp_path):  # noqa: F811
    workdir = str(tmp_path)
    # 8 steps: the resume from step 6 runs fragment 0's round (step 7) and a quiet step, two of the programs
    cfg = small_config(text_file, **{"loco.bits": "2", "diloco.bits": "2", "steps": 8})
    # the first half runs the settings an older version ran (the reference), as that version would have
    first = small_config(text_file, **{"loco.bits": "2", "diloco.bits": "2", "loco.preset": "reference",
                                       "diloco.preset": "reference", "steps": 8})
    train_and_evaluate(first, workdir, log=quiet, stop_after=6)
    path = os.path.join(workdir, "config.json")
    saved = json.load(open(path))
    assert {n: saved["loco"][n] for n in config_lib.RESOLVED_FIELDS["loco"]} == loco.REFERENCE
    assert {n: saved["diloco"][n] for n in config_lib.RESOLVED_FIELDS["diloco"]} == diloco.REFERENCE
    # the same workdir as an older version would have left it: no format, rotate or preset recorded
    for section in ("loco", "diloco"):
        for name in ("format", "rotate", "preset"):
            del saved[section][name]
    saved["loco"].update(beta=0.8, compensate=True, compensate_second_stage=False)
    saved["diloco"]["compensate"] = False
    json.dump(saved, open(path, "w"))
    lines = []
    summary = train_and_evaluate(cfg, workdir, log=lines.append)
    assert any("resumed from checkpoint at step 6" in line for line in lines)
    assert summary["last_step"] == 8
    resumed = json.load(open(path))
    assert {n: resumed["loco"][n] for n in config_lib.RESOLVED_FIELDS["loco"]} == loco.REFERENCE
    assert {n: resumed["diloco"][n] for n in config_lib.RESOLVED_FIELDS["diloco"]} == diloco.REFERENCE
    # an explicit change of a resolved setting on resume is still refused by name
    with pytest.raises(ValueError, match="loco.format"):
        train_and_evaluate(small_config(text_file, **{"loco.bits": "2", "diloco.bits": "2",
                                                              "loco.format": "uniform", "steps": 14}), workdir, log=quiet)


def test_the_config_takes_its_defaults_from_the_library():
    """Every config field that sets an argument of the library (``loco.compress`` and ``loco.codec``;
    ``diloco.diloco``, ``diloco.codec`` and ``exchange.Sparse.of``) defaults to that argument's own default
    (one set of defaults), but for the application's stated choices: ``loco.bits`` (the exact mean),
    ``diloco.sync_every`` (the library has none), and the sparse exchange's ``density`` (None: a dense
    exchange; ``error_decay`` None is Sparse.of's own decay, and is not one of its arguments' names). The outer step's defaults are the library's constants, which
    ``diloco(outer=None)`` builds its Nesterov SGD from."""
    import dataclasses
    import inspect

    from loco_jax import diloco, exchange, loco
    from loco_jax.training.run import config as config_lib

    own = {("loco", "bits"), ("diloco", "sync_every"), ("diloco", "density")}
    for section, fields, fns, least in (
            ("loco", config_lib.LocoFields(), (loco.compress, loco.codec), 10),
            ("diloco", config_lib.DilocoFields(), (diloco.diloco, diloco.codec, exchange.Sparse.of), 13)):
        checked = 0
        for f in dataclasses.fields(fields):
            owners = [fn for fn in fns if f.name in inspect.signature(fn).parameters]
            if (section, f.name) in own or not owners:
                continue
            assert getattr(fields, f.name) == inspect.signature(owners[0]).parameters[f.name].default, (section, f.name)
            checked += 1
        assert checked >= least, (section, checked)
    d = config_lib.DilocoFields()
    assert (d.outer_lr, d.outer_momentum) == (diloco.OUTER_LR, diloco.OUTER_MOMENTUM) == (0.7, 0.9)
