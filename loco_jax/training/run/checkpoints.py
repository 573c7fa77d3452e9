"""Orbax checkpoints of the train state, split into global, per-replica and per-device items, and the
elastic restore onto another ``(replica, data)`` mesh.

Layout: ``<workdir>/checkpoints/<step>/{global,replica,device,meta}``. A leaf's item follows its
``PartitionSpec`` (``P()``: global; ``P("replica")``: one block per replica; anything over ``data``: per
device). ``meta`` holds the step, the data position, the bytes sent and the mesh.
"""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from loco_jax.training import model as model_lib
from loco_jax.training.run import config as config_lib
from loco_jax.training.run.steps import TrainState


def _kind(spec):
    """'global', 'replica' or 'device' from a leaf's PartitionSpec."""
    if spec == P():
        return "global"
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return "replica" if axes == ("replica",) else "device"


def split_by_kind(tree, specs):
    """{'global'|'replica'|'device': {path: leaf}}: the checkpoint layout."""
    out = {"global": {}, "replica": {}, "device": {}}
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(leaves, spec_leaves):
        out[_kind(spec)][jax.tree_util.keystr(path)] = leaf
    return out


def join_by_kind(parts, like):
    """Inverse of :func:`split_by_kind` onto the structure of ``like``."""
    merged = {k: v for part in parts.values() for k, v in part.items()}
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
    return jax.tree.unflatten(jax.tree.structure(like), [merged[p] for p in paths])




@functools.cache  # once per process: the backend does not change
def _save_replicated_arrays_whole_on_cpu():
    """On CPU, one replica writes each replicated array whole (orbax's ``use_replica_parallel=False``).

    By default orbax splits a replicated array's write across its replicas, cutting every shard with
    eager jax slices: one small compiled program per slice shape, about 5 s of a tiny recipe's 12-step
    run on 2 cores, spent on copies of arrays that already live in host memory. orbax makes the same
    choice itself on GPU (``JAX_PLATFORMS=cuda``); the files written are the same either way.
    """
    import orbax.checkpoint as ocp

    if jax.default_backend() == "cpu":
        handler = ocp.type_handlers.ArrayHandler(use_replica_parallel=False)
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        absl_log.setLevel(logging.ERROR)  # orbax warns of every override; this one is meant
        try:
            ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)
        finally:
            absl_log.setLevel(level)


def complete_checkpoint_steps(workdir) -> list[int]:
    """Steps of the complete checkpoints on disk, oldest first, read without orbax (nothing is created).

    Orbax writes into a temporary folder and renames it to the bare step number when the checkpoint is
    complete, so a folder named by an int is a finished one.
    """
    folder = os.path.join(workdir, "checkpoints")
    names = os.listdir(folder) if os.path.isdir(folder) else ()
    return sorted(int(n) for n in names if n.isdigit() and os.path.isdir(os.path.join(folder, n)))


def checkpoint_manager(workdir, keep):
    import orbax.checkpoint as ocp

    _save_replicated_arrays_whole_on_cpu()
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


def save(manager, step, trainer, state, extra):
    import orbax.checkpoint as ocp

    parts = split_by_kind(state, trainer.specs)
    args = {k: ocp.args.StandardSave(v) for k, v in parts.items() if v}
    args["meta"] = ocp.args.JsonSave(extra)
    manager.save(step, args=ocp.args.Composite(**args))
    manager.wait_until_finished()


def restore(manager, step, trainer, mesh_recorded=True):
    """The state and meta of a checkpoint written on this mesh, restored into abstract shapes (the fresh
    state is never allocated beside it). Saved shapes are checked first (:func:`_check_saved_shapes`)."""
    import orbax.checkpoint as ocp

    like = trainer.abstract_state()
    parts = split_by_kind(like, trainer.specs)
    upgraded = _per_replica_counts_from_global(manager, step, parts, trainer.m)
    _check_saved_shapes(manager, step, parts, trainer, mesh_recorded)
    args = {k: ocp.args.StandardRestore(v) for k, v in parts.items() if v and not (upgraded and k == "global")}
    args["meta"] = ocp.args.JsonRestore()
    restored = dict(manager.restore(step, args=ocp.args.Composite(**args)).items())
    if upgraded and parts["global"]:  # the older global item also holds the leaves now kept per replica
        restored["global"] = ocp.PyTreeCheckpointer().restore(_item_path(manager, step, "global"), args=ocp.args.PyTreeRestore(
            item=parts["global"], restore_args=ocp.checkpoint_utils.construct_restore_args(parts["global"]),
            partial_restore=True))
    loaded = {k: restored[k] for k in parts if parts[k]}
    for k in parts:
        loaded.setdefault(k, {})
    loaded["replica"].update(upgraded)
    return join_by_kind(loaded, like), restored["meta"]


def _per_replica_counts_from_global(manager, step, parts, replicas):
    """Leaves of the older DiLoCo layout, read and taken out of ``parts``: {key: array}.

    Before replicas skipped non-finite steps alone, DiLoCo's ``skipped`` count and the inner optimizer's
    leaves that did not vary over replicas (step counts, LoCo's ``skipped`` and key) were global; now each
    replica keeps its own (one block per replica, a scalar as shape ``(1,)``), and ``dropped`` (rounds
    dropped) was not counted. Such a checkpoint resumes with every replica's block the global value
    (identical on every replica then) and ``dropped`` at 0.
    """
    saved_global, saved_replica = saved_leaves(manager, step, "global"), saved_leaves(manager, step, "replica")
    out = {}

    def put(key, want, host):
        out[key] = jax.make_array_from_callback(want.shape, want.sharding, lambda idx: host[idx])

    for key, want in list(parts["replica"].items()):
        old = saved_global.get(key)
        block = (1,) if old is not None and tuple(old.shape) == () else tuple(getattr(old, "shape", ()))
        if key not in saved_replica and old is not None and (block[0] * replicas,) + block[1:] == tuple(want.shape):
            value = np.asarray(_read_leaf(manager, step, "global", key)).reshape(block)
            put(key, want, np.concatenate([value] * replicas).astype(want.dtype))
            del parts["replica"][key]
    key = ".opt_state.dropped"
    if out and key in parts["global"] and key not in saved_global:
        want = parts["global"].pop(key)
        put(key, want, np.zeros(want.shape, want.dtype))
    return out


def read_meta(manager, step):
    import orbax.checkpoint as ocp

    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


INFLIGHT = ".opt_state.inflight"  # checkpoint key of DiLoCoState.inflight (TrainState.opt_state is the DiLoCo state)


def _item_path(manager, step, item):
    return os.path.join(str(manager.directory), str(step), item)


def saved_leaves(manager, step, item):
    """{path: metadata with .shape and .dtype} of one checkpoint item, read without loading any array."""
    import orbax.checkpoint as ocp

    path = _item_path(manager, step, item)
    if not os.path.isdir(path):
        return {}
    saved = ocp.PyTreeCheckpointer().metadata(path).item_metadata
    return dict(getattr(saved, "tree", saved))


def _read_leaf(manager, step, item, key):
    """A host copy of one leaf of a checkpoint item, at its saved shape (a partial restore)."""
    import orbax.checkpoint as ocp

    saved = saved_leaves(manager, step, item)[key]
    args = ocp.args.PyTreeRestore(item={key: np.zeros(saved.shape, saved.dtype)},
                                  restore_args={key: ocp.RestoreArgs(restore_type=np.ndarray)}, partial_restore=True)
    return ocp.PyTreeCheckpointer().restore(_item_path(manager, step, item), args=args)[key]


def _check_saved_shapes(manager, step, parts, trainer, mesh_recorded):
    """Refuses a checkpoint whose arrays do not fit ``parts`` (this run's state by kind), before any restore.

    Checkpoints record the mesh they were written on, and a different mesh is an elastic restart; on the
    same mesh every leaf must fit exactly. A checkpoint without that record (written before it existed)
    can only be resumed on the mesh it was written on.
    """
    for kind, leaves in parts.items():
        saved = saved_leaves(manager, step, kind)
        for key, want in leaves.items():
            have = saved.get(key)
            if have is None or tuple(have.shape) != tuple(want.shape):
                found = "missing" if have is None else f"shape {tuple(have.shape)}"
                why, fix = (("was written by another version of loco-jax", "Start a new --workdir")
                            if mesh_recorded else
                            ("does not record the mesh it was written on", "Resume it on the mesh it was written on"))
                raise ValueError(
                    f"the checkpoint at step {step} {why}: its state leaf {key!r} is {found} where this run "
                    f"(mesh replica={trainer.m}, data={trainer.d}) needs shape {tuple(want.shape)}. {fix}."
                )


def _in_flight(trainer, diloco_step):
    """(fragment, steps left) of an exchange sent but not yet applied after DiLoCo step ``diloco_step``, or None."""
    for j in range(1, trainer.cfg.diloco.overlap):
        ph = trainer.phase(diloco_step + j)  # None: data parallel, which has nothing in flight
        if ph is not None and ph.apply is not None and ph.apply != ph.send:
            return ph.apply, j
    return None


def _check_elastic(manager, step, trainer, saved_mesh):
    """Refuses, by name, a checkpoint an elastic restart cannot read: an FSDP run's, or one written before
    replicas kept their own skip counts."""
    m_old, d_old = saved_mesh["replica"], saved_mesh["data"]
    fsdp = trainer.cfg.mesh.fsdp
    if fsdp or saved_mesh.get("fsdp"):
        raise ValueError(
            f"this checkpoint was written on mesh (replica={m_old}, data={d_old}, fsdp={bool(saved_mesh.get('fsdp'))}) "
            f"and this run has (replica={trainer.m}, data={trainer.d}, fsdp={fsdp}): an elastic restart "
            "of an FSDP run (sharded state) is not supported. Resume it on the mesh it was written on "
            f"(--set mesh.replicas={m_old} mesh.data={d_old} on {m_old * d_old} devices)."
        )
    if ".opt_state.skipped" in saved_leaves(manager, step, "global"):
        raise ValueError(
            f"the checkpoint at step {step} was written before replicas kept their own skip counts, on mesh "
            f"(replica={m_old}, data={d_old}); an elastic restart needs today's layout. Resume it once on that mesh "
            f"(--set mesh.replicas={m_old} mesh.data={d_old} on {m_old * d_old} devices) until its next checkpoint, "
            "then restart on the new mesh."
        )


def restore_elastic(manager, step, trainer, saved_mesh, log):
    """Restores a checkpoint written on another (replica, data) mesh: an elastic restart.

    The rule: global parameters, outer optimizer states and every step count
    carry over (they are the same on every device); each replica's local
    parameters start from the global ones; its inner optimizer state is
    replica 0's (``elastic_inner_state="copy"``) or fresh moments with
    replica 0's counts (``"reset"``: step counts, so the learning-rate schedule
    goes on, and skip counts); LoCo's and the outer exchange's error buffers
    (per device) restart at zero. An in-flight exchange (overlap >= 2, a
    checkpoint between a fragment's send and its apply) is completed: the old
    replicas' mean outer gradient is already in the checkpoint (identical on
    every replica), so it is re-cut into the new data devices' slices
    (``tx.relayout_inflight``) and applied at its scheduled step, exactly as
    the old mesh would have applied it. The data position is global (sample
    index), so it is kept.
    """
    import orbax.checkpoint as ocp

    m_old, d_old = saved_mesh["replica"], saved_mesh["data"]
    cfg = trainer.cfg
    _check_elastic(manager, step, trainer, saved_mesh)
    like = trainer.abstract_state()
    parts = split_by_kind(like, trainer.specs)
    old_shape = lambda a: (a.shape[0] // trainer.m * m_old,) + tuple(a.shape[1:])
    args = {"meta": ocp.args.JsonRestore()}
    if parts["global"]:
        args["global"] = ocp.args.StandardRestore(parts["global"])
    if parts["replica"]:  # host copies of the old layout: replica 0's block is read from them
        args["replica"] = ocp.args.StandardRestore({k: np.zeros(old_shape(a), a.dtype) for k, a in parts["replica"].items()})
    restored = manager.restore(step, args=ocp.args.Composite(**args))
    meta = restored["meta"]
    fresh_parts = split_by_kind(trainer.init_state(), trainer.specs)  # zero error buffers, fresh moments
    device = dict(fresh_parts["device"])
    flight = _in_flight(trainer, int(restored["global"][".opt_state.step"]))
    if flight is not None:
        saved = _read_leaf(manager, step, "device", INFLIGHT)
        moved = trainer.tx.relayout_inflight(saved, model_lib.abstract_params(trainer.mcfg), flight[0],
                                             (m_old, d_old), (trainer.m, trainer.d))
        device[INFLIGHT] = jax.make_array_from_callback(moved.shape, device[INFLIGHT].sharding, lambda idx: moved[idx])
    replica = {}
    for key, old in restored.get("replica", {}).items():
        fresh = fresh_parts["replica"][key]
        reset = cfg.elastic_inner_state == "reset" and jnp.issubdtype(fresh.dtype, jnp.inexact)  # counts kept
        if key.startswith(".params") or reset:
            replica[key] = fresh  # params: replaced by the global ones below
        else:
            tiled = np.concatenate([np.asarray(old)[: old.shape[0] // m_old]] * trainer.m)  # replica 0's block
            replica[key] = jax.make_array_from_callback(tiled.shape, fresh.sharding, lambda idx, t=tiled: t[idx])
    state = join_by_kind({"global": restored.get("global", {}), "replica": replica, "device": device}, like)
    # the parameters the steps train start from the model's (DiLoCo: each replica's block from the global ones)
    tile = jax.jit(trainer.tile, out_shardings=trainer.shardings(trainer.param_specs))
    state = TrainState(tile(trainer.eval_params(state)), state.opt_state)
    inner = "copied from replica 0" if cfg.elastic_inner_state == "copy" else "reset (moments zero, step counts kept)"
    log(f"elastic restart at step {step}: mesh (replica={m_old}, data={d_old}) -> (replica={trainer.m}, "
        f"data={trainer.d}); global parameters, outer optimizer states and step counts carried over (every new "
        f"replica's skip count is replica 0's); local parameters start from the global ones; inner optimizer state "
        f"{inner}; LoCo and outer error buffers "
        "restart at zero; data position kept")
    if flight is not None and not np.all(np.isfinite(saved)):
        log(f"elastic restart: fragment {flight[0]}'s round was dropped (its exchanged mean was non-finite); the "
            "fragment syncs again at its next turn")
    elif flight is not None:
        log(f"elastic restart: fragment {flight[0]}'s outer-gradient mean was in flight (sent by the old replicas); "
            f"it is re-cut for the new mesh and applied in {flight[1]} step(s), as scheduled")
    return state, meta


def saved_config(workdir):
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def check_resume_config(workdir, cfg, old, log):
    """``old``: the run's saved ``config.json`` (None for a fresh workdir)."""
    if old is None:
        return
    old = config_lib.with_reference_fields(old)  # an older run's unrecorded fields: the settings it ran with
    new = config_lib.to_dict(cfg)
    changed = config_lib.changed_fields(old, new)
    frozen = [k for k in changed if k.split(".")[0] in config_lib.FROZEN_ON_RESUME
              and k not in config_lib.CHANGEABLE_ON_RESUME]
    if frozen:
        raise ValueError(
            f"the run in {workdir!r} was started with a different configuration: {', '.join(frozen)} changed "
            f"(e.g. {frozen[0]}: {_get(old, frozen[0])!r} -> {_get(new, frozen[0])!r}). These fields cannot change "
            "on resume; use a new --workdir."
        )
    if "steps" in changed:
        log(f"resume: steps changed {old['steps']} -> {new['steps']}; the learning-rate schedule (cosine decay to "
            "the last step) changes with it")


def _get(d, dotted):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def restore_step(manager, step, trainer, log):
    """(state, meta) of checkpoint ``step``: restored directly on the mesh it was written on, by
    :func:`restore_elastic` on another one (a checkpoint that records no mesh must fit this one)."""
    saved_mesh = read_meta(manager, step).get("mesh")
    layout = lambda mesh: (mesh["replica"], mesh["data"], bool(mesh.get("fsdp")), mesh.get("local", 1))
    if saved_mesh is not None and layout(saved_mesh) != (trainer.m, trainer.d, trainer.cfg.mesh.fsdp,
                                                         trainer.cfg.mesh.local):
        return restore_elastic(manager, step, trainer, saved_mesh, log)
    return restore(manager, step, trainer, mesh_recorded=saved_mesh is not None)
