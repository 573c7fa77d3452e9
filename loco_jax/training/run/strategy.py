"""How a run spreads its steps over the mesh: plain data parallel, or Streaming DiLoCo over ``replica``.

The trainer, the loop and the checkpoints ask the run's strategy (:func:`of`) wherever the two differ, in
place of branching on ``cfg.diloco.enabled``:

- :class:`DataParallel`: one replica; every step's gradient is averaged over the data devices (LoCo or the
  exact mean), a non-finite step is skipped on every device (:func:`loco_jax.loco.skip_nonfinite`), and the
  parameters are the model.
- :class:`StreamingDiLoCo`: ``M`` replicas on the mesh's ``replica`` axis, each with its own block of local
  parameters (stacked on dim 0); :func:`loco_jax.diloco.diloco` wraps the inner optimizer, one compiled
  program per phase of its schedule, and the model is the global parameters in the outer state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from loco_jax import diloco, exchange, loco


class DataParallel:
    """Plain data parallel: one replica, the parameters replicated (or FSDP-sharded) over ``data``."""

    name = "data parallel"
    leading = None  # the parameters' leading mesh axis
    count_specs = {"skipped": P()}  # the skip counts as the step programs return them: one replicated count

    def __init__(self, cfg):
        self.cfg = cfg

    def check_replicas(self, m):
        if m != 1:
            raise ValueError(f"mesh.replicas={m} needs diloco.enabled=True; plain data parallel runs on one replica "
                             "(set mesh.replicas=1 to average over every device).")

    def wrap(self, inner: optax.GradientTransformation, sharded: bool) -> optax.GradientTransformation:
        """The step's optimizer around ``inner``: a non-finite step leaves Adam untouched too."""
        return loco.skip_nonfinite(inner)

    def check_plan(self, tx, local_params):
        """Refuses, before anything compiles, what the optimizer cannot lay out (nothing here)."""

    def replicas_stacked(self, m: int) -> int:
        """How many blocks of parameters the state stacks on dim 0."""
        return 1

    def tile(self, params, m):
        return params

    def state_specs(self, tx, params, mesh, in_specs):
        return loco.state_specs(tx, params, mesh, in_specs=in_specs)

    def phase(self, tx, step):
        """The compiled program's key for a step: one program for every step."""
        return None

    def counts(self, opt_state) -> dict:
        """The optimizer's skip counts (every device skips together)."""
        return {"skipped": opt_state.skipped}

    def model_params(self, state):
        """The parameters that are the model (evaluated, sampled, exported)."""
        return state.params

    def schedule_offset(self, state, start: int) -> int:
        """Loop steps minus the optimizer's own count at a resume (0: the loop's step picks the program)."""
        return 0

    def log_fields(self, counts: dict) -> dict:
        """What a metrics row adds from the skip counts (the row's ``skipped_steps`` says it all here)."""
        return {}

    def compared_params(self, state, resumed: bool, param_specs, global_param_specs):
        """(tree, specs) that every replica must hold identically before training, or None: one replica."""
        return None


class StreamingDiLoCo(DataParallel):
    """Streaming DiLoCo over the mesh's ``replica`` axis (``cfg.diloco``), the data-parallel step inside."""

    name = "Streaming DiLoCo"
    leading = "replica"
    count_specs = {"skipped": P("replica"), "dropped": P()}  # per replica, and the rounds dropped (replicated)

    def check_replicas(self, m):
        """Any number of replicas, one included."""

    def wrap(self, inner, sharded):
        """``diloco.diloco`` around ``inner``: the outer step, fragments, overlap and exchange of ``cfg.diloco``
        (FSDP, ``sharded``: each device exchanges its own shard over ``replica``)."""
        d = self.cfg.diloco
        outer_lr = d.outer_lr
        if d.outer_lr_decay:  # counted in the fragment's own rounds: its outer state steps once per round
            outer_lr = optax.cosine_decay_schedule(d.outer_lr, max(1, self.cfg.steps // d.sync_every),
                                                   alpha=self.cfg.optim.min_lr_ratio)
        outer = optax.sgd(outer_lr, momentum=d.outer_momentum or None, nesterov=d.outer_momentum > 0)
        return diloco.diloco(
            inner, sync_every=d.sync_every, bits=self.outer_exchange(), outer=outer, alpha=d.alpha,
            num_fragments=d.num_fragments, overlap=d.overlap, data_axis=None if sharded else "data", mode=d.mode,
        )

    def outer_exchange(self):
        """The outer exchange of ``cfg.diloco`` as one value: ``exchange.Sparse.of(density, ...)`` where
        ``density`` is set, else ``diloco.codec(bits, ...)`` (``config.validate`` refused the settings of the
        other kind)."""
        d = self.cfg.diloco
        if d.density is not None:
            decay = {} if d.error_decay is None else dict(decay=d.error_decay)
            return exchange.Sparse.of(d.density, bits=d.bits, format=d.format, chunk=d.chunk, block_size=d.block_size,
                                      average_over=d.average_over, chunks=d.chunks, keep_unsent=d.keep_unsent, **decay)
        return diloco.codec(d.bits, preset=d.preset, format=d.format, compensate=d.compensate, rotate=d.rotate,
                            block_size=d.block_size, seed=self.cfg.seed)

    def check_plan(self, tx, local_params):
        tx.plan(local_params)  # the fragments

    def replicas_stacked(self, m):
        return m

    def tile(self, params, m):
        """One block of local parameters per replica, stacked on dim 0.

        A broadcast, then a reshape: compiled with the replica-split output sharding, each device keeps its
        own block and nothing moves (a concatenate of M copies compiled to one all-to-all per leaf, no two
        of them ordered)."""
        return jax.tree.map(lambda x: jnp.broadcast_to(x[None], (m,) + x.shape).reshape(
            (m * x.shape[0],) + x.shape[1:]), params)

    def state_specs(self, tx, params, mesh, in_specs):
        return diloco.state_specs(tx, params, mesh, in_specs=in_specs)

    def phase(self, tx, step):
        """The DiLoCo phase of loop step ``step``, from the host's count alone: the schedule counts skipped
        steps too (``diloco`` module docstring), so nothing is read back to pick a program."""
        return tx.phase(step)

    def counts(self, opt_state):
        """Each replica's ``skipped`` steps and the ``dropped`` rounds (a non-finite exchanged mean)."""
        return {"skipped": opt_state.skipped, "dropped": opt_state.dropped}

    def model_params(self, state):
        return diloco.global_params(state.opt_state)

    def schedule_offset(self, state, start):
        """0, except for checkpoints written before the schedule counted skipped steps (they held the
        applied steps only); the phase of loop step ``t`` is ``phase(t - offset)`` either way."""
        return start - int(state.opt_state.step)

    def log_fields(self, counts):
        """The exchanges dropped, and who skipped."""
        skipped = counts["skipped"]
        fields = {"dropped_exchanges": counts["dropped"]}
        if len(skipped) > 1:
            fields["skipped_by_replica"] = [int(n) for n in skipped]
        return fields

    def compared_params(self, state, resumed, param_specs, global_param_specs):
        """A fresh run compares the local parameters (each replica's block); a resumed one every device's
        copy of the global parameters (local ones differ between syncs by design)."""
        if resumed:
            return diloco.global_params(state.opt_state), global_param_specs
        return state.params, param_specs


def of(cfg):
    """The strategy of a resolved config: :class:`StreamingDiLoCo` where ``cfg.diloco.enabled``."""
    return StreamingDiLoCo(cfg) if cfg.diloco.enabled else DataParallel(cfg)
