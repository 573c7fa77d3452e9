"""Training loop: pure ``train_step`` / ``eval_step`` under ``shard_map``, checkpoints, metrics.

``train_and_evaluate(config, workdir)`` runs a whole experiment:

- the mesh ``(replica, data)`` from ``config.mesh`` (:mod:`loco_jax.mesh`);
- the inner optimizer: ``loco.compress`` on ``data`` (``config.loco.bits``;
  ``None`` is the exact fp32 mean), gradient clipping, AdamW with linear
  warm-up and cosine decay; wrapped in ``diloco.diloco`` on ``replica`` when
  ``config.diloco.enabled`` (one compiled program per DiLoCo phase, picked
  in the Python loop with ``tx.phase(step)``), else plain data parallel;
- the step recipe of the README: parameters cast to varying over ``data``
  before ``jax.grad`` (no hidden fp32 psum), state ``PartitionSpec`` s from
  the library's ``state_specs`` helpers;
- evaluation on the global parameters (DiLoCo) or the parameters (DP);
- metrics as JSON lines, a progress line, a loss plot;
- orbax checkpoints split into global, per-replica and per-device items,
  resumed bit-identically by rerunning the same command in the same workdir.

Workdir contents: ``config.json`` (the resolved config), ``metrics.jsonl``,
``checkpoints/<step>/``, ``loss.png``, ``programs.json`` (bytes each compiled
program moves, from ``hlo.collective_bytes``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import config as config_lib
from loco_jax import data as data_lib
from loco_jax import diloco, hlo, loco, specs
from loco_jax import mesh as mesh_lib
from loco_jax import model as model_lib

BATCH_SPEC = P(("replica", "data"))


# ---------------------------------------------------------------------------- optimizer and steps


def learning_rate_schedule(cfg: config_lib.Config):
    """Linear warm-up to ``optim.lr``, cosine decay to ``lr * min_lr_ratio`` at ``steps``.

    A warm-up of ``steps`` or more is shortened to ``steps - 1`` (the trainer logs it): the peak is reached.
    """
    o = cfg.optim
    warmup = min(o.warmup_steps, max(cfg.steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1),
        end_value=o.lr * o.min_lr_ratio,
    )


def make_optimizer(cfg: config_lib.Config):
    """The step's optax transformation: LoCo (or exact mean) on ``data``, clip, AdamW; DiLoCo outside."""
    o, c = cfg.optim, cfg.loco
    parts = [
        loco.compress(
            c.bits, beta=c.beta, compensate=c.compensate, error_bits=c.error_bits, block_size=c.block_size,
            reset_every=c.reset_every, compensate_second_stage=c.compensate_second_stage, axis_name="data",
            format=c.format, rotate=c.rotate, preset=c.preset, seed=cfg.seed,
        )
    ]
    if o.grad_clip is not None:
        parts.append(optax.clip_by_global_norm(o.grad_clip))
    parts.append(optax.adamw(learning_rate_schedule(cfg), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay))
    inner = optax.chain(*parts)
    d = cfg.diloco
    if not d.enabled:
        return loco.skip_nonfinite(inner)  # a non-finite step leaves Adam untouched too
    outer = optax.sgd(d.outer_lr, momentum=d.outer_momentum or None, nesterov=d.outer_momentum > 0)
    return diloco.diloco(
        inner, sync_every=d.sync_every, outer=outer, num_fragments=d.num_fragments, overlap=d.overlap,
        alpha=d.alpha, bits=d.bits, format=d.format, compensate=d.compensate, rotate=d.rotate, mode=d.mode,
        block_size=d.block_size, preset=d.preset, seed=cfg.seed,
    )


def model_config(cfg: config_lib.Config) -> model_lib.ModelConfig:
    m = cfg.model
    return model_lib.ModelConfig(
        vocab_size=m.vocab_size, d_model=m.d_model, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, d_ff=m.d_ff, max_seq_len=m.max_seq_len, tie_embeddings=m.tie_embeddings,
        scan_layers=m.scan_layers, remat=m.remat, compute_dtype=m.compute_dtype,
    )


def train_step(tx, mcfg, params, opt_state, inputs, targets, *, phase=None):
    """One step inside ``shard_map``: loss, gradient (no hidden psum), the optimizer, new params."""
    varying = lax.pcast(params, "data", to="varying")  # the README recipe
    loss, grads = jax.value_and_grad(lambda p: model_lib.loss_fn(mcfg, p, inputs, targets))(varying)
    extra = {} if phase is None else {"phase": phase}
    updates, opt_state = tx.update(grads, opt_state, params, **extra)
    params = optax.apply_updates(params, updates)
    grad_sq = sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads))
    grad_rms = jnp.sqrt(grad_sq / sum(g.size for g in jax.tree.leaves(grads)))  # this device's local gradient
    axes = ("replica", "data")
    metrics = {name: lax.pmean(specs.to_varying(v, axes), axes) for name, v in (("loss", loss), ("grad_rms", grad_rms))}
    return params, opt_state, metrics


def eval_step(mcfg, params, inputs, targets):
    """Mean loss over the eval batch, inside ``shard_map`` (params identical everywhere)."""
    return lax.pmean(model_lib.loss_fn(mcfg, params, inputs, targets), ("replica", "data"))


# ---------------------------------------------------------------------------- state layout for checkpoints


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


# ---------------------------------------------------------------------------- data


class Dataset:
    """Token streams of the config and this process's rows of each global batch."""

    def __init__(self, cfg: config_lib.Config, log=print):
        d = cfg.data
        sp = d.tokenizer == "sentencepiece"
        self.tokens = data_lib.load_data(
            d.path, tokenizer=d.tokenizer, vocab_size=d.sp_vocab_size if sp else None, cache_dir=d.cache_dir
        )
        if self.tokens.vocab_size > cfg.model.vocab_size:
            source = f"the token file {d.path!r}" if d.path and data_lib.is_token_file(d.path) else f"the {d.tokenizer} tokenizer"
            raise ValueError(
                f"{source} uses {self.tokens.vocab_size} token ids but model.vocab_size={cfg.model.vocab_size}; "
                f"raise model.vocab_size to at least {self.tokens.vocab_size}."
            )
        self.cfg = cfg
        self.process, self.processes = jax.process_index(), jax.process_count()
        log(f"data: {self.tokens.source or 'shakespeare'}; {len(self.tokens.train_tokens):,} train and "
            f"{len(self.tokens.eval_tokens):,} eval tokens ({d.tokenizer} tokenizer)")

    def train_iterator(self, seed, state=None):
        batcher = data_lib.Batcher(self.tokens.train_tokens, seq_len=self.cfg.seq_len, seed=seed)
        return _ProcessBatcher(batcher.restore(state) if state else batcher, self.process, self.processes)

    def eval_batches(self, batch_size, count):
        """The same ``count`` global batches every time: the first windows of the eval stream."""
        inputs, targets = data_lib.eval_windows(self.tokens.eval_tokens, seq_len=self.cfg.seq_len,
                                                max_windows=batch_size * count)
        rows = data_lib.process_rows(batch_size, self.process, self.processes)
        for b in range(len(inputs) // batch_size):
            chunk = slice(b * batch_size, (b + 1) * batch_size)
            yield inputs[chunk][rows], targets[chunk][rows]


class _ProcessBatcher:
    def __init__(self, batcher, process, processes):
        self.batcher, self.process, self.processes = batcher, process, processes

    def next_batch(self, global_batch):
        return self.batcher.next_batch(global_batch, process_index=self.process, num_processes=self.processes)

    def state(self):
        return self.batcher.state()


# ---------------------------------------------------------------------------- the run


class TrainState(NamedTuple):
    params: Any
    opt_state: Any


def _emit(line):
    print(line, flush=True)


class _Progress:
    """One updating line on a terminal, plain log lines elsewhere."""

    def __init__(self, total):
        self.total, self.tty = total, sys.stderr.isatty()

    def update(self, step, text):
        if self.tty:
            width = 30
            done = int(width * step / self.total)
            sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} {text}   ")
            sys.stderr.flush()

    def close(self):
        if self.tty:
            sys.stderr.write("\n")


class Trainer:
    """Builds the mesh, data, programs and state of a config; ``run()`` trains."""

    def __init__(self, cfg: config_lib.Config, workdir: str, log=_emit):
        cfg = config_lib.resolve(cfg)  # idempotent on a resolved config; None settings take the library defaults
        self.cfg, self.workdir, self.log = cfg, workdir, log
        self.mesh = mesh_lib.make_mesh(cfg.mesh.replicas, cfg.mesh.data)
        self.m, self.d = self.mesh.shape["replica"], self.mesh.shape["data"]
        if not cfg.diloco.enabled and self.m != 1:
            raise ValueError(
                f"mesh.replicas={self.m} needs diloco.enabled=True; plain data parallel runs on one replica "
                "(set mesh.replicas=1 to average over every device)."
            )
        n_dev = self.m * self.d
        if cfg.batch_size % n_dev:
            raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the {n_dev} devices of the mesh.")
        self.mcfg = model_config(cfg)
        self.tx = make_optimizer(cfg)
        if cfg.diloco.enabled:
            self.tx.plan(model_lib.abstract_params(self.mcfg))  # fragments checked before anything compiles
        self.schedule = learning_rate_schedule(cfg)
        self._dataset = None
        self._programs, self.program_bytes = {}, {}
        self.param_spec = P("replica") if cfg.diloco.enabled else P()

    @property
    def dataset(self):
        """Loaded on first use (benchmarks that only compile need no data)."""
        if self._dataset is None:
            self._dataset = Dataset(self.cfg, self.log)
        return self._dataset

    def abstract_batch(self):
        shape = (self.cfg.batch_size, self.cfg.seq_len)
        sharding = NamedSharding(self.mesh, BATCH_SPEC)
        return (jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding),) * 2

    # ------------------------------------------------------------ state

    def init_state(self):
        params = model_lib.init_params(self.mcfg, jax.random.PRNGKey(self.cfg.seed))
        if self.cfg.diloco.enabled:  # one block of local parameters per replica, concatenated on dim 0
            params = jax.tree.map(lambda x: jnp.concatenate([x] * self.m), params)
        params = jax.device_put(params, NamedSharding(self.mesh, self.param_spec))
        state_specs = self._state_specs(params)
        init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=self.param_spec, out_specs=state_specs))
        self.specs = TrainState(jax.tree.map(lambda _: self.param_spec, params), state_specs)
        return TrainState(params, init(params))

    def _state_specs(self, params):
        if self.cfg.diloco.enabled:
            return diloco.state_specs(self.tx, params, self.mesh)
        return loco.state_specs(self.tx, params, self.mesh)

    def abstract_state(self):
        """Shapes and shardings of the train state, without allocating it (for restores)."""
        state = jax.eval_shape(self.init_state)
        shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s), self.specs, is_leaf=lambda x: isinstance(x, P))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state, shardings)

    # ------------------------------------------------------------ programs

    def program(self, phase, state, batch):
        """The compiled step program of a DiLoCo phase (None for DP); compiled once, bytes recorded."""
        if phase not in self._programs:
            fn = lambda p, s, x, y: train_step(self.tx, self.mcfg, p, s, x, y, phase=phase)
            specs = self.specs
            f = jax.jit(
                jax.shard_map(
                    fn, mesh=self.mesh, in_specs=(specs.params, specs.opt_state, BATCH_SPEC, BATCH_SPEC),
                    out_specs=(specs.params, specs.opt_state, P()),
                ),
                donate_argnums=(0, 1),
            )
            compiled = f.lower(state.params, state.opt_state, *batch).compile()
            report = hlo.collective_bytes(compiled)
            cross = sum(op.total_bytes for op in report.ops if self.m > 1 and op.spans(self.d)) * self.d
            self.program_bytes[str(phase)] = {"per_device": report.total, "cross_replica_per_replica": cross}
            self._programs[phase] = compiled
        return self._programs[phase]

    def eval_program(self):
        if "eval" not in self._programs:
            fn = lambda p, x, y: eval_step(self.mcfg, p, x, y)
            self._programs["eval"] = jax.jit(
                jax.shard_map(fn, mesh=self.mesh, in_specs=(P(), BATCH_SPEC, BATCH_SPEC), out_specs=P())
            )
        return self._programs["eval"]

    def loco_error_rms(self, state):
        """RMS of LoCo's stored errors over every device (a diagnostic for the metrics)."""
        if self.cfg.loco.bits is None or not self.cfg.loco.compensate:
            return None
        if "diag" not in self._programs:
            fn = lambda s: loco.error_rms(s, self.cfg.loco.block_size, self.cfg.loco.error_bits)
            self._programs["diag"] = jax.jit(
                jax.shard_map(fn, mesh=self.mesh, in_specs=(self.specs.opt_state,), out_specs=P())
            )
        return float(self._programs["diag"](state.opt_state))

    def eval_params(self, state):
        if self.cfg.diloco.enabled:
            return diloco.global_params(state.opt_state)
        return state.params

    def put_batch(self, rows):
        sharding = NamedSharding(self.mesh, BATCH_SPEC)
        return tuple(jax.make_array_from_process_local_data(sharding, np.asarray(a)) for a in rows)

    def evaluate(self, state):
        losses = []
        for inputs, targets in self.dataset.eval_batches(self.cfg.batch_size, self.cfg.eval_batches):
            losses.append(float(self.eval_program()(self.eval_params(state), *self.put_batch((inputs, targets)))))
        return float(np.mean(losses))

    # ------------------------------------------------------------ loop

    def phase(self, step):
        return self.tx.phase(step) if self.cfg.diloco.enabled else None

    def skipped(self, state):
        """Steps skipped for non-finite values so far (the outermost counter: DiLoCo's or skip_nonfinite's)."""
        return int(state.opt_state.skipped)

    def phase_of(self, state):
        """The DiLoCo phase of the next step, from the state's own step count.

        A skipped step does not advance that count, so the schedule follows the
        steps that happened (one scalar read per step; None for data parallel).
        """
        return self.tx.phase(int(state.opt_state.step) + 1) if self.cfg.diloco.enabled else None


def _metrics_path(workdir):
    return os.path.join(workdir, "metrics.jsonl")


def read_metrics(workdir):
    path = _metrics_path(workdir)
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a kill: the rows after the checkpoint are logged again
    return rows


def _write_atomic(path, text):
    """Writes ``text`` to ``path`` through a temporary file and a rename: a kill leaves old or new, never half."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _truncate_metrics(workdir, last_step):
    """Drops metric rows logged after the checkpoint we resume from (they will be logged again)."""
    rows = [r for r in read_metrics(workdir) if r.get("step", 0) <= last_step]
    _write_atomic(_metrics_path(workdir), "".join(json.dumps(r) + "\n" for r in rows))


def summary_table(workdir) -> str:
    """The eval rows of a run as a small text table (printed at the end of a run)."""
    rows = [r for r in read_metrics(workdir) if "eval_loss" in r]
    lines = ["  step   train loss   eval loss   bytes sent / device", "  ----   ----------   ---------   -------------------"]
    for r in rows:
        train = f"{r['loss']:10.3f}" if "loss" in r else " " * 10
        sent = hlo.human_bytes(r["bytes_sent_per_device"]) if "bytes_sent_per_device" in r else ""
        lines.append(f"  {r['step']:4d}   {train}   {r['eval_loss']:9.3f}   {sent:>19}")
    return "\n".join(lines)


def plot(workdir, out=None):
    """Writes ``loss.png``: train and eval loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(workdir)
    out = out or os.path.join(workdir, "loss.png")
    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss (global params)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(os.path.basename(os.path.abspath(workdir)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


class _Stop:
    """SIGTERM: finish the current step, write a checkpoint, exit 0."""

    def __init__(self):
        self.requested = False

    def __call__(self, signum, frame):
        self.requested = True


def _checkpoint_manager(workdir, keep):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")), options=options)


def _save(manager, step, trainer, state, extra):
    import orbax.checkpoint as ocp

    parts = split_by_kind(state, trainer.specs)
    args = {k: ocp.args.StandardSave(v) for k, v in parts.items() if v}
    args["meta"] = ocp.args.JsonSave(extra)
    manager.save(step, args=ocp.args.Composite(**args))
    manager.wait_until_finished()


def _restore(manager, step, trainer, mesh_recorded=True):
    """The state and meta of a checkpoint written on this mesh, restored into abstract shapes (the fresh
    state is never allocated beside it). Saved shapes are checked first (:func:`_check_saved_shapes`)."""
    import orbax.checkpoint as ocp

    like = trainer.abstract_state()
    parts = split_by_kind(like, trainer.specs)
    _check_saved_shapes(manager, step, parts, trainer, mesh_recorded)
    args = {k: ocp.args.StandardRestore(v) for k, v in parts.items() if v}
    args["meta"] = ocp.args.JsonRestore()
    restored = manager.restore(step, args=ocp.args.Composite(**args))
    loaded = {k: restored[k] for k in parts if parts[k]}
    for k in parts:
        loaded.setdefault(k, {})
    return join_by_kind(loaded, like), restored["meta"]


def _read_meta(manager, step):
    import orbax.checkpoint as ocp

    return manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]


INFLIGHT = ".opt_state.inflight"  # checkpoint key of DiLoCoState.inflight (TrainState.opt_state is the DiLoCo state)


def _item_path(manager, step, item):
    return os.path.join(str(manager.directory), str(step), item)


def _saved_leaves(manager, step, item):
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

    saved = _saved_leaves(manager, step, item)[key]
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
        saved = _saved_leaves(manager, step, kind)
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
        ph = trainer.tx.phase(diloco_step + j)
        if ph.apply is not None and ph.apply != ph.send:
            return ph.apply, j
    return None


def restore_elastic(manager, step, trainer, saved_mesh, log):
    """Restores a checkpoint written on another (replica, data) mesh: an elastic restart.

    The rule: global parameters, outer optimizer states and every step count
    carry over (they are the same on every device); each replica's local
    parameters start from the global ones; its inner optimizer state is
    replica 0's (``elastic_inner_state="copy"``) or fresh moments with the step
    counts kept (``"reset"``); LoCo's and the outer exchange's error buffers
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
    cfg, mesh = trainer.cfg, trainer.mesh
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
    flight = _in_flight(trainer, int(restored["global"][".opt_state.step"])) if cfg.diloco.enabled else None
    if flight is not None:
        saved = _read_leaf(manager, step, "device", INFLIGHT)
        moved = trainer.tx.relayout_inflight(saved, model_lib.abstract_params(trainer.mcfg), flight[0],
                                             (m_old, d_old), (trainer.m, trainer.d))
        device[INFLIGHT] = jax.make_array_from_callback(moved.shape, device[INFLIGHT].sharding, lambda idx: moved[idx])
    replica = {}
    for key, old in restored.get("replica", {}).items():
        fresh = fresh_parts["replica"][key]
        if key.startswith(".params") or cfg.elastic_inner_state == "reset":
            replica[key] = fresh  # params: replaced by the global ones below
        else:
            tiled = np.concatenate([np.asarray(old)[: old.shape[0] // m_old]] * trainer.m)  # replica 0's block
            replica[key] = jax.make_array_from_callback(tiled.shape, fresh.sharding, lambda idx, t=tiled: t[idx])
    state = join_by_kind({"global": restored.get("global", {}), "replica": replica, "device": device}, like)
    if cfg.diloco.enabled:
        tile = jax.jit(lambda g: jax.tree.map(lambda x: jnp.concatenate([x] * trainer.m), g),
                       out_shardings=NamedSharding(mesh, trainer.param_spec))
        state = TrainState(tile(diloco.global_params(state.opt_state)), state.opt_state)
    inner = "copied from replica 0" if cfg.elastic_inner_state == "copy" else "reset (moments zero, step counts kept)"
    log(f"elastic restart at step {step}: mesh (replica={m_old}, data={d_old}) -> (replica={trainer.m}, "
        f"data={trainer.d}); global parameters, outer optimizer states and step counts carried over; local "
        f"parameters start from the global ones; inner optimizer state {inner}; LoCo and outer error buffers "
        "restart at zero; data position kept")
    if flight is not None:
        log(f"elastic restart: fragment {flight[0]}'s outer-gradient mean was in flight (sent by the old replicas); "
            f"it is re-cut for the new mesh and applied in {flight[1]} step(s), as scheduled")
    return state, meta


def _saved_config(workdir):
    path = os.path.join(workdir, "config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _check_resume_config(workdir, cfg, old, log):
    """``old``: the run's saved ``config.json`` (None for a fresh workdir)."""
    if old is None:
        return
    old = config_lib.with_reference_fields(old)  # an older run's unrecorded fields: the settings it ran with
    new = config_lib.to_dict(cfg)
    changed = config_lib.changed_fields(old, new)
    frozen = [k for k in changed if k.split(".")[0] in config_lib.FROZEN_ON_RESUME]
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


def train_and_evaluate(cfg: config_lib.Config, workdir: str, log=_emit, stop_after: int | None = None) -> dict:
    """Trains ``cfg`` in ``workdir`` (resuming from its latest checkpoint); returns a summary.

    ``stop_after``: checkpoint after that step and return, as a pre-emption would (tests, schedulers).
    """
    config_lib.validate(cfg)
    os.makedirs(workdir, exist_ok=True)
    saved = _saved_config(workdir)
    cfg = config_lib.resolve(cfg, saved)  # None settings: the run's own, else the library's
    _check_resume_config(workdir, cfg, saved, log)
    trainer = Trainer(cfg, workdir, log)
    trainer.dataset  # load (or download) the data before anything compiles
    is_main = jax.process_index() == 0
    log(f"{mesh_lib.describe(trainer.mesh)}; model {model_lib.count_params(trainer.mcfg):,} parameters; "
        f"{'Streaming DiLoCo' if cfg.diloco.enabled else 'data parallel'}, loco bits={cfg.loco.bits}")
    if cfg.optim.warmup_steps >= cfg.steps:
        log(f"warning: optim.warmup_steps={cfg.optim.warmup_steps} >= steps={cfg.steps}; the warm-up is shortened to "
            f"{max(cfg.steps - 1, 0)} step(s) so the learning rate still reaches its peak and decays")

    manager = _checkpoint_manager(workdir, cfg.keep_checkpoints)
    start, data_state, bytes_so_far = 0, None, 0.0
    latest = manager.latest_step()
    if latest is None:
        state = trainer.init_state()
    else:
        saved_mesh = _read_meta(manager, latest).get("mesh")
        if saved_mesh is not None and (saved_mesh["replica"], saved_mesh["data"]) != (trainer.m, trainer.d):
            state, meta = restore_elastic(manager, latest, trainer, saved_mesh, log)
        else:
            state, meta = _restore(manager, latest, trainer, mesh_recorded=saved_mesh is not None)
        start, data_state, bytes_so_far = meta["step"], meta["data"], meta.get("bytes_sent", 0.0)
        log(f"resumed from checkpoint at step {start}")
    batches = trainer.dataset.train_iterator(seed=cfg.data.seed, state=data_state)
    _check_replicas_identical(trainer, state, resumed=latest is not None)
    if is_main:  # written once the start is known to be sound: a refused resume leaves the workdir as it was
        _write_atomic(os.path.join(workdir, "config.json"), config_lib.dumps(cfg))
        _truncate_metrics(workdir, start)  # rows logged after the checkpoint (or with none) come again
    stop = _Stop()
    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread: no SIGTERM handling
        previous = None
    progress = _Progress(cfg.steps)
    metrics_file = open(_metrics_path(workdir), "a") if is_main else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t_last, steps_since, last_saved = time.perf_counter(), 0, start
    skipped_seen = trainer.skipped(state)
    eval_loss = None
    try:
        for step in range(start + 1, cfg.steps + 1):
            inputs, targets = batches.next_batch(cfg.batch_size)
            batch = trainer.put_batch((inputs, targets))
            phase = trainer.phase_of(state)
            prog = trainer.program(phase, state, batch)
            params, opt_state, out = prog(state.params, state.opt_state, *batch)
            state = TrainState(params, opt_state)
            if jax.default_backend() == "cpu":
                # XLA's CPU collectives can deadlock with several multi-device programs in flight.
                jax.block_until_ready(state)
            bytes_so_far += trainer.program_bytes[str(phase)]["per_device"]
            steps_since += 1
            if cfg.nonfinite == "stop" and trainer.skipped(state) > 0:
                raise FloatingPointError(
                    f"non-finite gradients or outer gradients at step {step} (nonfinite='stop'); the step was not "
                    "applied. Set nonfinite='skip' to skip such steps and go on."
                )
            if trainer.skipped(state) > skipped_seen:
                log(f"warning: step {step} had non-finite values and was skipped on every device "
                    f"({trainer.skipped(state)} skipped so far)")
                skipped_seen = trainer.skipped(state)
            row = None
            if step % cfg.log_every == 0 or step == cfg.steps:
                loss = float(out["loss"])
                now = time.perf_counter()
                row = {
                    # the optimizer's own count: skipped steps do not advance the schedule
                    "step": step, "loss": loss, "lr": float(trainer.schedule(step - 1 - trainer.skipped(state))),
                    "tokens_per_s": tokens_per_step * steps_since / (now - t_last),
                    "bytes_sent_per_device": bytes_so_far, "skipped_steps": trainer.skipped(state),
                    "grad_rms": float(out["grad_rms"]),
                }
                error_rms = trainer.loco_error_rms(state)
                if error_rms is not None:
                    row["loco_error_rms"] = error_rms
                    row["loco_error_to_grad"] = error_rms / max(row["grad_rms"], 1e-30)
                t_last, steps_since = now, 0
                if not math.isfinite(loss) and cfg.nonfinite == "stop":
                    raise FloatingPointError(f"non-finite loss {loss} at step {step} (nonfinite='stop').")
            if step % cfg.eval_every == 0 or step == cfg.steps:
                eval_loss = trainer.evaluate(state)
                row = dict(row or {"step": step}, eval_loss=eval_loss)
            if row is not None:
                if metrics_file:
                    metrics_file.write(json.dumps(row) + "\n")
                    metrics_file.flush()
                progress.update(step, f"loss {row.get('loss', float('nan')):.3f}" + (f" eval {eval_loss:.3f}" if eval_loss else ""))
                if not progress.tty:
                    log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
            if stop_after is not None and step >= stop_after:
                stop.requested = True
            if jax.process_count() > 1:  # every process stops at the same step, or collectives hang
                from jax.experimental import multihost_utils

                stop.requested = bool(np.any(multihost_utils.process_allgather(np.array(stop.requested))))
            if step % cfg.checkpoint_every == 0 or step == cfg.steps or stop.requested:
                _save(manager, step, trainer, state, {"step": step, "data": batches.state(), "bytes_sent": bytes_so_far,
                                                      "mesh": {"replica": trainer.m, "data": trainer.d}})
                last_saved = step
            if stop.requested:
                log(f"stop requested: checkpoint written at step {step}; exiting")
                break
    finally:
        progress.close()
        if metrics_file:
            metrics_file.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        manager.close()
    if is_main:
        with open(os.path.join(workdir, "programs.json"), "w") as f:
            json.dump(trainer.program_bytes, f, indent=2)
        log(summary_table(workdir))
        log(f"loss plot: {plot(workdir)}; metrics: {_metrics_path(workdir)}")
    return {"last_step": last_saved, "eval_loss": eval_loss, "stopped": stop.requested, "state": state}


def _check_replicas_identical(trainer, state, resumed):
    """Every replica must hold the same starting point: refuse to train otherwise.

    A fresh run compares the local parameters (each replica's block); a resumed
    one compares every device's copy of the global parameters (local ones
    differ between syncs by design). A checksum over ``replica`` on device.
    """
    if not trainer.cfg.diloco.enabled or trainer.m == 1:
        return
    tree, spec = (diloco.global_params(state.opt_state), P()) if resumed else (state.params, trainer.param_spec)
    # max - min over replicas is exact (a pmean of identical values rounds for most replica counts)
    gap_fn = lambda t: sum(jnp.max(lax.pmax(x, "replica") - lax.pmin(x, "replica")) for x in jax.tree.leaves(t))
    fn = jax.jit(jax.shard_map(gap_fn, mesh=trainer.mesh, in_specs=spec, out_specs=P(), check_vma=False))
    gap = float(fn(tree))
    if gap != 0.0:
        what = "global" if resumed else "initial"
        raise RuntimeError(f"replicas hold different {what} parameters (max difference {gap:g}); refusing to train.")
