"""Non-finite values end to end through the trainer: a poisoned step is skipped where it happened, or stops the run.

Three faults, each at one step of a real run (Streaming DiLoCo 2 x 4 with LoCo
4-bit inside, and data parallel):

* a corrupted batch: token ids beyond the vocabulary on one device (the
  embedding lookup then yields NaN, as a bit flip in a token buffer would);
* an Inf in the gradient of one device (the loss of the rows carrying a marker
  token is scaled by Inf);
* a NaN in the outer gradient of one replica, as it is sent (the operand of the
  exchange's all-gather is NaN on that replica; its inner step is untouched).

Streaming DiLoCo: replicas decide alone between syncs, so the replica whose
gradient is non-finite skips its own step and the other goes on; a non-finite
outer gradient from any replica makes the exchanged mean non-finite on every
replica, and that fragment's round is dropped everywhere (it syncs again at
its next turn). Each case logs a warning and a count in the metrics, and
nothing in the state (error buffers, global parameters, outer momentum, Adam
moments) is poisoned. The schedule is a clock (every step counts, so the loop
picks each step's phase without reading the device). Data parallel skips the
step on every device and ends bit-identical to a run in which that batch
never came.
"""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax import lax

from loco_jax.training import model as model_lib
from loco_jax import diloco
from loco_jax.training.run.loop import train_and_evaluate
from loco_jax.training.run.metrics import read_metrics
from loco_jax.training.run.steps import train_step
from loco_jax.training.run.trainer import Dataset, Trainer
from loco_jax.training.run import steps
from tests.helpers import HostReads, quiet_reads, small_config, sync_steps

BAD_STEP = 9  # Streaming DiLoCo (H 6, P 3, tau 1) sends fragment 1 at step 9: an exchange step
INF_MARK, NAN_OUTER_MARK = 254, 255  # byte ids the test corpus (ASCII words) never contains
_TRAIN_STEP = train_step  # the real one, which the fault injector wraps


class _Batches:
    """The run's batch stream with one batch corrupted (``corrupt``) or dropped (``drop``) at call ``at``."""

    def __init__(self, inner, at, corrupt=None, drop=False):
        self.inner, self.at, self.corrupt, self.drop, self.calls = inner, at, corrupt, drop, 0

    def next_batch(self, n):
        self.calls += 1
        if self.drop and self.calls == self.at:
            self.inner.next_batch(n)  # the batch the faulty run skips: never seen here
        inputs, targets = self.inner.next_batch(n)
        if self.corrupt is not None and self.calls == self.at:
            inputs, targets = self.corrupt(np.array(inputs), np.array(targets))
        return inputs, targets

    def state(self):
        return self.inner.state()


_OUTER_FAULT = {}  # while a step traces: the flag that poisons this replica's outer gradient as it is sent


def _poisoned_encode(encode):
    """``diloco.Exchange.encode`` whose slice is NaN where the traced fault flag is on (this replica's)."""
    def poisoned(self, slice_f32, *args, **kwargs):
        if "on" in _OUTER_FAULT:
            slice_f32 = jnp.where(_OUTER_FAULT["on"], jnp.nan, slice_f32)
        return encode(self, slice_f32, *args, **kwargs)
    return poisoned


def _poisoning_train_step(tx, mcfg, params, opt_state, inputs, targets, **kwargs):
    """The real ``train_step`` with two fault injectors keyed on marker tokens in this device's rows.

    Rows holding INF_MARK scale this device's loss (hence its gradient) by Inf.
    Rows holding NAN_OUTER_MARK on any device of a replica make that replica's
    outer gradient NaN where the exchange's all-gather receives it (DiLoCo's
    inner step is untouched). Without markers both are exact no-ops (``where``
    picks the original values).
    """
    inf_here = jnp.any(inputs == INF_MARK)
    _OUTER_FAULT["on"] = lax.pmax(jnp.any(inputs == NAN_OUTER_MARK).astype(jnp.int32), "data") > 0
    loss_fn = model_lib.loss_fn
    model_lib.loss_fn = lambda *a, **kw: loss_fn(*a, **kw) * jnp.where(inf_here, jnp.inf, 1.0)  # while this traces
    try:
        return _TRAIN_STEP(tx, mcfg, params, opt_state, inputs, targets, **kwargs)
    finally:
        model_lib.loss_fn = loss_fn
        _OUTER_FAULT.clear()


def _corrupt_ids(inputs, targets):  # device (replica 1, data 2) of the 2 x 4 mesh: rows 12-13 of 16
    inputs[12:14, 5:9] = 10_000
    return inputs, targets


def _inf_gradient(inputs, targets):  # device (replica 0, data 1): rows 2-3
    inputs[2, 3] = INF_MARK
    return inputs, targets


def _nan_outer(inputs, targets):  # replica 0 only (rows 0-7), marked on its device 3
    inputs[7, 0] = NAN_OUTER_MARK
    return inputs, targets


FAULTS = {"corrupted batch": _corrupt_ids, "Inf gradient on one device": _inf_gradient,
          "NaN outer gradient on one replica": _nan_outer}


def _run(monkeypatch, cfg, workdir, *, corrupt=None, drop=False, stop_after=None):
    original = Dataset.train_iterator
    monkeypatch.setattr(Dataset, "train_iterator",
                        lambda self, seed, state=None: _Batches(original(self, seed, state), BAD_STEP, corrupt, drop))
    monkeypatch.setattr(steps, "train_step", _poisoning_train_step)
    monkeypatch.setattr(diloco.Exchange, "encode", _poisoned_encode(diloco.Exchange.encode))
    logs = []
    try:
        summary = train_and_evaluate(cfg, str(workdir), log=logs.append, stop_after=stop_after)
    finally:  # a failing run must not leave the injectors in place for later tests
        monkeypatch.undo()
    return summary, logs


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _assert_finite(tree):
    for path, x in jax.tree_util.tree_flatten_with_path(_host(tree))[0]:
        if np.issubdtype(x.dtype, np.floating):
            assert np.all(np.isfinite(x)), f"non-finite values in {jax.tree_util.keystr(path)}"


@pytest.fixture(scope="module")
def clean_reference(text_file, tmp_path_factory):  # noqa: F811
    """The same run with no fault, and the initial global parameters.

    It also counts host reads of device arrays (tests/test_async.py): Streaming DiLoCo with overlap 1
    reads nothing on a quiet step (1, 3, 5, 7, 9, 11: exchange steps 7, 9 and 11 among them)."""
    monkeypatch = pytest.MonkeyPatch()
    cfg = small_config(text_file)
    reads = HostReads().install(monkeypatch)
    summary, _ = _run(monkeypatch, cfg, tmp_path_factory.mktemp("clean"))
    assert quiet_reads(reads.by_step, cfg) == {}, dict(reads.by_step)
    assert reads.step == cfg.steps and all(reads.by_step[t] for t in sync_steps(cfg))
    t = Trainer(cfg, str(tmp_path_factory.mktemp("init")))
    return summary, _host(diloco.global_params(t.init_state().opt_state)), t.tx.plan(model_lib.abstract_params(t.mcfg))


# (replicas that skip step 9, whether fragment 1's round at step 9 is dropped, the warning)
EXPECTED = {
    "corrupted batch": ([0, 1], False, "non-finite values on replica 1: that replica skipped the step"),
    "Inf gradient on one device": ([1, 0], False, "non-finite values on replica 0: that replica skipped the step"),
    "NaN outer gradient on one replica": ([0, 0], True, "the exchanged outer gradient of fragment 1 was non-finite"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_poisoned_step_is_skipped_by_its_replica_or_drops_the_round_everywhere(
        fault, text_file, clean_reference, monkeypatch, tmp_path):  # noqa: F811
    """Step 9 sends and applies fragment 1 (overlap 1): an inner fault skips one replica's step and the round
    goes on; an outer fault drops fragment 1's round on both replicas and every inner step goes on."""
    cfg = small_config(text_file)
    summary, logs = _run(monkeypatch, cfg, tmp_path, corrupt=FAULTS[fault])
    skipped, dropped, warning = EXPECTED[fault]
    state = summary["state"]
    assert np.asarray(state.opt_state.skipped).tolist() == skipped and int(state.opt_state.step) == cfg.steps
    assert int(state.opt_state.dropped) == int(dropped)
    assert any(line.startswith(f"warning: step {BAD_STEP}: {warning}") for line in logs), logs
    row = [r for r in read_metrics(str(tmp_path)) if "skipped_steps" in r][-1]
    assert (row["skipped_steps"], row["skipped_by_replica"], row["dropped_exchanges"]) == (sum(skipped), skipped, dropped)
    _assert_finite(state)  # error buffers, global params, outer momentum, Adam moments, in-flight buffer
    clean, initial, plan = clean_reference
    fragment = lambda tree, p: np.asarray(plan.extract(tree, p))
    faulty_global, clean_global = _host(diloco.global_params(state.opt_state)), _host(
        diloco.global_params(clean["state"].opt_state))
    # fragment 0 synced at step 7, before the fault, and not again: the same as in the clean run
    np.testing.assert_array_equal(fragment(faulty_global, 0), fragment(clean_global, 0))
    assert not np.array_equal(fragment(faulty_global, 0), fragment(initial, 0))
    assert not np.array_equal(fragment(clean_global, 1), fragment(initial, 1)), "the clean run synced fragment 1"
    if dropped:  # fragment 1's only round of the run was dropped: its global parameters never moved
        np.testing.assert_array_equal(fragment(faulty_global, 1), fragment(initial, 1))
    else:  # sent from the parameters of step 8 (overlap 1), before the fault: exactly the clean run's round
        np.testing.assert_array_equal(fragment(faulty_global, 1), fragment(clean_global, 1))
    assert np.isfinite(summary["eval_loss"])


def test_data_parallel_skips_a_poisoned_step_and_equals_the_run_without_it(text_file, monkeypatch, tmp_path):  # noqa: F811
    cfg = small_config(text_file, **{"mesh.replicas": 1, "diloco.enabled": False})
    faulty, logs = _run(monkeypatch, cfg, tmp_path / "faulty", corrupt=_inf_gradient)
    clean, _ = _run(monkeypatch, cfg, tmp_path / "clean", drop=True, stop_after=cfg.steps - 1)
    assert int(faulty["state"].opt_state.skipped) == 1
    assert any(line.startswith(f"warning: step {BAD_STEP}: non-finite values; the step was skipped on every device")
               for line in logs), logs
    _assert_finite(faulty["state"])
    inner = lambda s: s.opt_state.inner  # skip_nonfinite's wrapped chain: LoCo errors, clip, Adam
    jax.tree.map(np.testing.assert_array_equal, _host(faulty["state"].params), _host(clean["state"].params))
    jax.tree.map(np.testing.assert_array_equal, _host(inner(faulty["state"])), _host(inner(clean["state"])))


def test_nonfinite_stop_raises_and_keeps_only_clean_checkpoints(text_file, monkeypatch, tmp_path):  # noqa: F811
    cfg = small_config(text_file, nonfinite="stop", checkpoint_every=2)
    with pytest.raises(FloatingPointError, match=f"step {BAD_STEP}.*nonfinite='stop'"):
        _run(monkeypatch, cfg, tmp_path, corrupt=_corrupt_ids)
    monkeypatch.undo()
    steps = ocp.CheckpointManager(str(tmp_path / "checkpoints")).all_steps()
    assert steps and max(steps) < BAD_STEP, steps
