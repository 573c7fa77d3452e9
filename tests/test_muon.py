"""Muon as the inner optimizer (optim.name="muon"): which leaves it takes, the trainer with it, and its limits."""

import jax
import numpy as np
import optax
import pytest

from loco_jax.training.run import config as config_lib
from loco_jax.training import model as model_lib
from loco_jax.training.run import steps
from tests.helpers import small_config

quiet = lambda *_: None


@pytest.mark.parametrize("scan", [False, True])
def test_muon_takes_the_blocks_matrices_and_leaves_embedding_head_and_norms_to_adamw(scan):
    shapes = model_lib.ModelConfig(vocab_size=64, d_model=32, num_layers=2, num_heads=2, d_ff=64,
                                   scan_layers=scan).shapes()
    dims = steps.muon_dims(shapes)
    flat = {jax.tree_util.keystr(p): d for p, d in jax.tree_util.tree_flatten_with_path(
        dims, is_leaf=lambda x: x is None or isinstance(x, optax.contrib.MuonDimensionNumbers))[0]}
    muon = sorted(k for k, d in flat.items() if d is not None)
    assert len(muon) == 7 * (1 if scan else 2)  # wq wk wv wo w_gate w_up w_down per block
    assert all("layers" in k and "kernel" in k for k in muon)
    for k in ("['embed']['embedding']", "['lm_head']['kernel']", "['final_norm']['scale']"):
        assert flat[k] is None, k
    nd = 3 if scan else 2  # a scanned stack's layer axis is a batch axis
    assert {(d.reduction_axis, d.output_axis) for d in flat.values() if d is not None} == {(nd - 2, nd - 1)}


def test_the_trainer_with_muon_learns_and_resumes_bit_identically(text_file, tmp_path):  # noqa: F811
    """Data parallel with Muon inside (the benchmarks measure it inside DiLoCo, dense and sparse)."""
    from loco_jax.training.run.loop import train_and_evaluate
    from loco_jax.training.run.metrics import read_metrics

    sets = {"optim.name": "muon", "diloco.enabled": False, "mesh.replicas": 1}
    straight = train_and_evaluate(small_config(text_file, **sets), str(tmp_path / "a"), log=quiet)
    losses = [r["loss"] for r in read_metrics(str(tmp_path / "a")) if "loss" in r]
    assert losses[-1] < losses[0]
    muon_states = [x for x in jax.tree.leaves(straight["state"].opt_state,
                                              is_leaf=lambda x: isinstance(x, optax.contrib.MuonState))
                   if isinstance(x, optax.contrib.MuonState)]
    assert muon_states  # the run's inner optimizer is Muon's
    resumed_dir = str(tmp_path / "b")
    train_and_evaluate(small_config(text_file, **sets), resumed_dir, log=quiet, stop_after=7)
    resumed = train_and_evaluate(small_config(text_file, **sets), resumed_dir, log=quiet)
    for a, b in zip(jax.tree.leaves(resumed["state"]), jax.tree.leaves(straight["state"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_optimizer_settings_are_refused_by_name(text_file):  # noqa: F811
    with pytest.raises(ValueError, match="optim.name='sgd' is unknown"):
        config_lib.validate(small_config(text_file, **{"optim.name": "sgd"}))
    with pytest.raises(ValueError, match="mesh.fsdp=true shards"):
        config_lib.validate(small_config(text_file, **{"optim.name": "muon", "mesh.fsdp": True}))
