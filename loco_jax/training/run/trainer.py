"""The ``Trainer``: mesh, data, compiled programs and train state of one config.

The loop that drives it is :mod:`loco_jax.training.run.loop`; checkpoints are
:mod:`loco_jax.training.run.checkpoints`; metrics, plot and progress are :mod:`loco_jax.training.run.metrics`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import fsdp, hlo, loco
from loco_jax.training import model as model_lib
from loco_jax.training.run import config as config_lib
from loco_jax.training.run import mesh as mesh_lib
from loco_jax.training.run import steps, strategy
from loco_jax.training.run.dataset import Dataset
from loco_jax.training.run.metrics import emit
from loco_jax.training.run.steps import TrainState, learning_rate_schedule, make_optimizer, model_config


def gpu_compiler_options(fsdp: bool, in_backward: bool = False) -> dict:
    """XLA options the trainer compiles its step programs with on GPUs (docs/results.md, "The GPU
    compiler's schedule", measured on the 1B and 8B recipes compiled for H200s).

    - The all-reduce combiner's threshold, 1 GiB: XLA:GPU's default left the 1B recipe's exact gradient
      mean as 171 all-reduces, one per leaf, run one after another; now a few.
    - Replicated state: every collective starts as early as its operands allow, with two in flight at
      once. Streaming DiLoCo's exchange depends on nothing the step computes, so it starts first and the
      whole step's compute runs under it (1B: 100 % of the gemm FLOPs; 0 % once the all-reduces were
      combined without these, which left the scheduler no second slot). Not with FSDP: there it moves
      the per-layer parameter gathers early too (+16 GiB per device on the 8B recipe) and does not put
      the exchange over the layer loops anyway.
    - LoCo in the backward pass (``loco.in_backward``) with FSDP: collectives start early with up to 32 in
      flight. A layer's all-to-all (issued at the top of the next layer's iteration) and that layer's
      parameter gathers are then all in flight under its backward compute (8B: 94.7 % of a micro-batch's
      backward gemm FLOPs under LoCo's exchange; the limit needs 5 for that). The scheduler counts a
      while loop as taking as many of the slots as its body keeps in flight, so Streaming DiLoCo's
      exchange across replicas can stay in flight over the layer loops only when the limit leaves room
      for both: 5 kept it after every loop but the last (9.0 % of the 8B send program's gemm FLOPs
      under it), 16 gave 93.7 %, 32 gives 100 % at 0.4 GiB more temporaries.
    """
    options = {"xla_gpu_all_reduce_combine_threshold_bytes": 1 << 30}
    if not fsdp:
        options.update({"xla_gpu_experimental_collective_start_as_early_as_possible": True,
                        "xla_gpu_experimental_parallel_collective_overlap_limit": 2})
    elif in_backward:
        options.update({"xla_gpu_experimental_collective_start_as_early_as_possible": True,
                        "xla_gpu_experimental_parallel_collective_overlap_limit": 32})
    return options


def _accum_steps(cfg, per_device, n_dev):
    """Micro-batches per step: ``accum_steps``, or the per-device batch over ``micro_batch`` when that is set."""
    where = f"the {per_device} sequences each device gets per step (batch_size={cfg.batch_size} over {n_dev} devices)"
    if cfg.micro_batch is not None:
        micro = min(cfg.micro_batch, per_device)
        if per_device % micro:
            raise ValueError(f"micro_batch={cfg.micro_batch} must divide {where}; choose a divisor of {per_device}.")
        return per_device // micro
    if per_device % cfg.accum_steps:
        raise ValueError(f"accum_steps={cfg.accum_steps} must divide {where}; choose a divisor of {per_device}.")
    return cfg.accum_steps


class Trainer:
    """Builds the mesh, data, programs and state of a config; :func:`loco_jax.training.run.loop.train_and_evaluate` trains with it."""

    def __init__(self, cfg: config_lib.Config, workdir: str, log=emit, devices=None):
        """``devices``: the mesh's devices (default: every visible one; compile-only GPU devices from
        ``jax.experimental.topologies`` let tools compile for GPUs on a machine without one)."""
        cfg = config_lib.resolve(cfg)  # idempotent on a resolved config; None settings take the library defaults
        config_lib.validate(cfg)  # what the config alone refuses, for callers that build a Trainer directly
        self.cfg, self.workdir, self.log = cfg, workdir, log
        self.mesh = mesh_lib.make_mesh(cfg.mesh.replicas, cfg.mesh.data, cfg.mesh.local, devices=devices)
        # d: the devices of one replica (data x local)
        self.m, self.d = self.mesh.shape["replica"], self.mesh.shape["data"] * self.mesh.shape.get("local", 1)
        self.batch_spec = steps.batch_spec(self.mesh)
        self.strategy = strategy.of(cfg)
        self.strategy.check_replicas(self.m)
        n_dev = self.m * self.d
        if cfg.batch_size % n_dev:
            raise ValueError(f"batch_size={cfg.batch_size} must be a multiple of the {n_dev} devices of the mesh.")
        per_device = cfg.batch_size // n_dev
        self.accum_steps = _accum_steps(cfg, per_device, n_dev)
        self.platform = self.mesh.devices.flat[0].platform
        self.mcfg = model_config(cfg, self.mesh.devices.flat[0])
        full = model_lib.abstract_params(self.mcfg)
        # FSDP: the dimension each leaf is cut on over the data devices (refused by name before compiling)
        self.shard_dims = fsdp.shard_dims(full, self.d) if cfg.mesh.fsdp else None
        # in-backward: one LoCo bucket per layer, exchanged as the backward pass produces it
        groups = steps.bucket_groups(full) if cfg.loco.in_backward else None
        self.exchanger = steps.make_exchanger(cfg, self.shard_dims, groups) if cfg.loco.in_backward else None
        self.tx = make_optimizer(cfg, self.shard_dims, norm_dims=self._norm_dims(full), groups=groups)
        leading = self.strategy.leading
        if self.shard_dims is not None:
            self.param_specs = fsdp.partition_specs(self.shard_dims, "data", leading=leading)
            self.global_param_specs = fsdp.partition_specs(self.shard_dims, "data")
            local = fsdp.local_shapes(full, self.shard_dims, self.d)
        else:
            self.param_specs = jax.tree.map(lambda _: P() if leading is None else P(leading), full)
            self.global_param_specs = jax.tree.map(lambda _: P(), full)
            local = full
        self.strategy.check_plan(self.tx, local)  # before anything compiles
        self.schedule = learning_rate_schedule(cfg)
        self._dataset = None
        self._programs, self.program_bytes = {}, {}
        self.compiling = contextlib.nullcontext  # entered while a step program compiles (the loop's watchdog pauses)

    def _norm_dims(self, full):
        """Replicated layout: the shards FSDP would cut, for a clipping norm summed as FSDP sums it (so the
        two layouts train alike); None where FSDP is on, has no layout for this model, or nothing clips."""
        if self.cfg.mesh.fsdp or self.cfg.optim.grad_clip is None or self.cfg.mesh.local > 1:
            return None
        try:
            return fsdp.shard_dims(full, self.d)
        except ValueError:  # a leaf with no dimension divisible by D: optax's norm of the whole tree
            return None

    @property
    def dataset(self):
        """Loaded on first use (benchmarks that only compile need no data)."""
        if self._dataset is None:
            self._dataset = Dataset(self.cfg, self.log)
        return self._dataset

    def abstract_batch(self):
        shape = (self.cfg.batch_size, self.cfg.seq_len)
        sharding = NamedSharding(self.mesh, self.batch_spec)
        return (jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding),) * 2

    # ------------------------------------------------------------ state

    def shardings(self, specs):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P))

    def tile(self, params):
        """The model's parameters as the state holds them (:meth:`strategy.StreamingDiLoCo.tile`: one block
        per replica; data parallel: as they are)."""
        return self.strategy.tile(params, self.m)

    def init_state(self):
        key = jax.random.PRNGKey(self.cfg.seed)
        shardings = self.shardings(self.param_specs)
        # One compiled init for every layout: FSDP creates its shards in place (no device ever holds the whole
        # model), and replicated state takes the same program, so both start from bit-identical parameters
        # (an eager init rounded differently from the compiled one in about a third of the values).
        params = jax.jit(lambda k: self.tile(model_lib.init_params(self.mcfg, k)), out_shardings=shardings)(key)
        return TrainState(params, self._init_opt_state(params))

    def _init_opt_state(self, params):
        state_specs = self._state_specs(params)
        init = jax.jit(jax.shard_map(self.tx.init, mesh=self.mesh, in_specs=(self.param_specs,), out_specs=state_specs))
        self.specs = TrainState(self.param_specs, state_specs)
        return init(params)

    def _state_specs(self, params):
        return self.strategy.state_specs(self.tx, params, self.mesh, self.param_specs)

    def abstract_state(self):
        """Shapes and shardings of the train state, without allocating it (for restores)."""
        m = self.strategy.replicas_stacked(self.m)
        params = jax.tree.map(
            lambda a, sh: jax.ShapeDtypeStruct((a.shape[0] * m,) + tuple(a.shape[1:]), a.dtype, sharding=sh),
            model_lib.abstract_params(self.mcfg), self.shardings(self.param_specs))
        opt_state = jax.eval_shape(self._init_opt_state, params)
        state = TrainState(params, opt_state)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state,
                            self.shardings(self.specs))

    # ------------------------------------------------------------ programs

    def program(self, phase, state, batch):
        """The compiled step program of a DiLoCo phase (None for DP); compiled once, bytes recorded."""
        if phase not in self._programs:
            def train_step_program(p, s, x, y):
                p, s, metrics = steps.train_step(self.tx, self.mcfg, p, s, x, y, phase=phase,
                                                 shard_dims=self.shard_dims, accum_steps=self.accum_steps,
                                                 exchanger=self.exchanger)
                # copies of the skip counts beside the metrics: the state itself is donated to the next step
                return p, s, dict(metrics, **self._counts(s))
            specs = self.specs
            counts = self._count_specs()
            f = jax.jit(
                jax.shard_map(
                    train_step_program, mesh=self.mesh, in_specs=(specs.params, specs.opt_state, self.batch_spec, self.batch_spec),
                    # metrics one per replica (averaged on the host at a sync step); the skip counts as stored
                    out_specs=(specs.params, specs.opt_state,
                               {"loss": P("replica"), "grad_rms": P("replica"), **counts}),
                ),
                donate_argnums=(0, 1),
            )
            with self.compiling():
                compiled = f.lower(state.params, state.opt_state, *batch).compile(self.compiler_options())
            report = hlo.collective_bytes(compiled)
            cross = sum(op.total_bytes for op in report.ops if self.m > 1 and op.spans(self.d)) * self.d
            self.program_bytes[str(phase)] = {"per_device": report.total, "cross_replica_per_replica": cross}
            self._programs[phase] = compiled
        return self._programs[phase]

    def compiler_options(self):
        """XLA options of the step programs: :func:`gpu_compiler_options` where the mesh's devices are GPUs."""
        if self.platform not in ("gpu", "cuda"):
            return None
        return gpu_compiler_options(self.cfg.mesh.fsdp, self.exchanger is not None)

    def read_steps(self, outs):
        """The step programs' metrics ``outs`` (one dict per step, oldest first) on the host: one program,
        one transfer, whatever their number.

        Returns NumPy arrays with one row per step: ``loss`` and ``grad_rms``, the mean over replicas
        (every replica takes the same number of sequences, so this is the step's mean); ``skipped``, every
        replica's count (shape ``(steps, replicas)``); ``dropped`` (DiLoCo) as stored. Inside the program
        each device stacks its replica's values and one ``all_gather`` over ``replica`` brings every
        replica's to every device (so each process of a multi-process run reads them all); the mean is taken
        after it, as ``jnp.mean`` over the replicas. One program with one collective, where a program per
        value per step (3 x ``log_every`` of them in flight at once) deadlocks XLA:CPU's collectives.
        """
        counts = self._count_specs()
        outs = [{k: o[k] for k in ("loss", "grad_rms", *counts)} for o in outs]
        key = ("read", len(outs))  # one program per number of steps read (a run has one or a few)
        if key not in self._programs:

            def read_program(outs):
                as_f32 = lambda n: jax.lax.bitcast_convert_type(n.reshape(()).astype(jnp.int32), jnp.float32)
                mine = jnp.stack([jnp.stack([o["loss"].reshape(()).astype(jnp.float32),
                                             o["grad_rms"].reshape(()).astype(jnp.float32), as_f32(o["skipped"])])
                                  for o in outs])  # (steps, 3): this replica's values, skip counts bit-exact
                every = jax.lax.all_gather(mine, "replica")  # (replicas, steps, 3)
                got = {"loss": jnp.mean(every[..., 0], axis=0), "grad_rms": jnp.mean(every[..., 1], axis=0),
                       "skipped": jax.lax.bitcast_convert_type(every[..., 2], jnp.int32).T}
                if "dropped" in counts:
                    got["dropped"] = jnp.stack([o["dropped"] for o in outs])
                return got

            metric_specs = {"loss": P("replica"), "grad_rms": P("replica"), **counts}
            self._programs[key] = jax.jit(jax.shard_map(
                read_program, mesh=self.mesh, in_specs=([metric_specs] * len(outs),), out_specs=P(), check_vma=False))
        return jax.device_get(self._programs[key](outs))

    def replica_values(self, per_replica):
        """Every replica's value of a per-replica array (the skip counts), replicated on every device so
        each process can read it: one program, at the start of a run (:meth:`skipped`)."""
        if "replica_values" not in self._programs:
            self._programs["replica_values"] = jax.jit(lambda x: x, out_shardings=NamedSharding(self.mesh, P()))
        return self._programs["replica_values"](per_replica)

    def eval_program(self):
        if "eval" not in self._programs:
            def eval_program(p, x, y):
                return steps.eval_step(self.mcfg, p, x, y, shard_dims=self.shard_dims)

            self._programs["eval"] = jax.jit(
                jax.shard_map(eval_program, mesh=self.mesh, in_specs=(self.global_param_specs, self.batch_spec, self.batch_spec),
                              out_specs=P())
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
        return self.strategy.model_params(state)

    def put_batch(self, rows):
        sharding = NamedSharding(self.mesh, self.batch_spec)
        return tuple(jax.make_array_from_process_local_data(sharding, np.asarray(a)) for a in rows)

    def evaluate(self, state):
        losses = []
        for inputs, targets in self.dataset.eval_batches(self.cfg.batch_size, self.cfg.eval_batches):
            losses.append(float(self.eval_program()(self.eval_params(state), *self.put_batch((inputs, targets)))))
        return float(np.mean(losses))

    # ------------------------------------------------------------ loop

    def phase(self, step):
        """The compiled program's key for loop step ``step``: its DiLoCo phase (None for data parallel)."""
        return self.strategy.phase(self.tx, step)

    def _counts(self, opt_state):
        """The optimizer's skip counts (:meth:`strategy.DataParallel.counts`)."""
        return self.strategy.counts(opt_state)

    def _count_specs(self):
        """How the step programs return the skip counts (:attr:`strategy.DataParallel.count_specs`)."""
        return self.strategy.count_specs

    def skipped(self, state):
        """The skip counts so far, on the host: ``skipped`` one per replica (data parallel: one), and
        ``dropped`` (DiLoCo's exchanges dropped for a non-finite mean; 0 for data parallel).

        A device read: only at steps that synchronise anyway.
        """
        counts = self._counts(state.opt_state)
        counts = jax.device_get(dict(counts, skipped=self.replica_values(counts["skipped"])))
        return {"skipped": np.atleast_1d(counts["skipped"]).astype(int), "dropped": int(counts.get("dropped", 0))}

