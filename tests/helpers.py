"""Small shared helpers: the multi-device tests', the trainer's (a small config; ``train.py`` in a subprocess).
The corpus they train on is conftest.py's ``text_file`` fixture."""

import collections
import functools
import inspect
import os
import socket
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax._src.array import ArrayImpl
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loco_jax import diloco, loco
from loco_jax.training.run import config as config_lib
from loco_jax.training.run.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEVICES = ("replica", "data")  # every device's own slice on the (2, 4) mesh


def put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def per_device(mesh, fn, *args, in_specs, check_vma=True):
    """Runs ``fn`` under shard_map and returns each device's output stacked on a new axis 0.

    ``fn``'s outputs may be invariant; stacking them lets a test compare devices.
    """

    def body(*a):
        return jax.tree.map(lambda o: o[None], fn(*a))

    spec = P(tuple(mesh.axis_names))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=check_vma))
    return f(*args)


def gaussian(shape, seed=0):
    return np.random.RandomState(seed).randn(*shape).astype(np.float32)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def free_port():
    """A TCP port free on localhost now (for a subprocess's coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def train_cmd(config_path, workdir, *extra):
    """The command line that runs this checkout's ``train.py`` on ``config_path`` into ``workdir``."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--config", config_path, "--workdir", workdir, *extra]


def subprocess_env():
    """The environment of a ``train.py`` subprocess: CPU, this checkout on the path, the session's cache."""
    # the test session's compilation cache (conftest.py): a subprocess compiling the same programs loads them
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT,
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(jax.config.jax_persistent_cache_min_compile_time_secs))
    env.pop("XLA_FLAGS", None)  # each process sets its own device count
    return env


# ----------------------------------------------------------------------------- the trainer's tests


def small_config(text_file, **overrides):
    cfg = config_lib.Config(steps=12, batch_size=16, seq_len=32, eval_every=6, eval_batches=1, log_every=2,
                            checkpoint_every=6, sample_tokens=0)
    m = cfg.model
    m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_seq_len, m.compute_dtype = 32, 2, 2, 96, 32, "float32"
    cfg.optim.warmup_steps = 2
    cfg.mesh.replicas = 2
    cfg.data.path = text_file
    cfg.loco.bits = 4
    cfg.loco.compensate = True  # the paper's compensated exchange: resumes and restarts carry error buffers
    d = cfg.diloco
    d.enabled, d.sync_every, d.num_fragments, d.overlap, d.alpha, d.bits = True, 6, 3, 1, 0.5, 4
    return config_lib.override(cfg, [f"{k}={v}" for k, v in overrides.items()])


def write_config_file(path, cfg):
    """A configs/NAME.py that rebuilds ``cfg`` (for subprocess runs of train.py)."""
    path.write_text(
        "from loco_jax.training.run import config\n"
        f"def get_config():\n    return config.from_dict({config_lib.to_dict(cfg)!r})\n"
    )
    return str(path)


def quiet(*_):
    """A ``log`` that prints nothing."""


# ----------------------------------------------------------------------------- host reads per loop step
# (tests/test_async.py: the loop keeps JAX's async dispatch)

CONVERSIONS = ("__array__", "__float__", "__int__", "__bool__", "__index__", "item", "tolist")


class HostReads:
    """Host conversions of ``jax.Array`` per loop step (0: before the first step)."""

    def __init__(self):
        self.step, self.by_step, self._local = 0, collections.Counter(), threading.local()

    def install(self, monkeypatch):
        for name in CONVERSIONS:
            monkeypatch.setattr(ArrayImpl, name, self._counted(getattr(ArrayImpl, name)))
        monkeypatch.setattr(jax, "device_get", self._counted(jax.device_get))
        program = Trainer.program

        def next_step(trainer_self, *args):
            self.step += 1
            return program(trainer_self, *args)

        monkeypatch.setattr(Trainer, "program", next_step)
        return self

    def _counted(self, fn):
        def wrapped(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self.by_step[self.step] += 1
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapped


def sync_steps(cfg):
    """The steps of ``cfg``'s run that may read the device: a log, eval or checkpoint row, or the last."""
    return {t for t in range(1, cfg.steps + 1)
            if t % cfg.log_every == 0 or t % cfg.eval_every == 0 or t % cfg.checkpoint_every == 0 or t == cfg.steps}


def quiet_reads(by_step, cfg):
    """The reads :class:`HostReads` counted on quiet steps (none is allowed)."""
    return {t: n for t, n in by_step.items() if t and t not in sync_steps(cfg)}


# ----------------------------------------------------------------------------- DiLoCo's toy problem
# (a small tanh network regressing sin(x w) on the (replica, data) = (2, 4) mesh: tests/test_diloco.py,
# tests/test_sparse.py)

M, D = 2, 4
N_LAYERS, WIDTH, D_IN, D_OUT = 2, 8, 4, 2
BATCH = 8  # per device


def make_params(seed=0, width=WIDTH):
    rng = np.random.RandomState(seed)
    w = lambda *s: jnp.asarray(rng.randn(*s) * 0.4, jnp.float32)
    return {
        "proj_in": {"kernel": w(D_IN, width)},
        "layers": {i: {"w": w(width, width), "b": w(width)} for i in range(N_LAYERS)},
        "head": {"kernel": w(width, D_OUT)},
    }


def loss_fn(p, x, y):
    h = x @ p["proj_in"]["kernel"]
    for i in range(N_LAYERS):
        h = h + jnp.tanh(h @ p["layers"][i]["w"] + p["layers"][i]["b"])
    return jnp.mean((h @ p["head"]["kernel"] - y) ** 2)


def make_data(steps, same_on_replicas=False, seed=1):
    """Per-step batches, global shape (M * D * BATCH, ...): rows of replica r, data device d come in that order."""
    rng = np.random.RandomState(seed)
    xs = rng.randn(steps, M * D * BATCH, D_IN).astype(np.float32)
    if same_on_replicas:
        xs[:, D * BATCH:] = xs[:, : D * BATCH]
    w = rng.randn(D_IN, D_OUT).astype(np.float32)
    return xs, np.sin(xs @ w)


def replicate(params):
    """Global view of local parameters: M identical blocks concatenated on dim 0."""
    return jax.tree.map(lambda x: jnp.concatenate([x] * M), params)


def local(tree, r):
    """Replica r's block of a global-view tree."""
    return jax.tree.map(lambda x: np.asarray(x).reshape(M, -1, *x.shape[1:])[r], tree)


class Run:
    """Jitted init and step programs of a DiLoCo transformation on the (2, 4) mesh."""

    def __init__(self, mesh, tx, width=WIDTH):
        self.mesh, self.tx = mesh, tx
        self.params = put(mesh, replicate(make_params(width=width)), P("replica"))
        self.specs = diloco.state_specs(tx, self.params, mesh)
        self.state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P("replica"), out_specs=self.specs))(self.params)
        self._programs = {}

    def body(self, params, state, x, y, phase=None):
        p = lax.pcast(params, "data", to="varying")
        grads = jax.grad(loss_fn)(p, x, y)
        updates, state = self.tx.update(grads, state, params, phase=phase)
        return optax.apply_updates(params, updates), state

    def program(self, phase):
        if phase not in self._programs:
            fn = functools.partial(self.body, phase=phase) if phase != "traced" else self.body
            in_specs = (P("replica"), self.specs, P(DEVICES), P(DEVICES))
            self._programs[phase] = jax.jit(
                jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=(P("replica"), self.specs))
            )
        return self._programs[phase]

    def step(self, t, x, y, traced=False):
        prog = self.program("traced" if traced else self.tx.phase(t))
        xs, ys = put(self.mesh, x, P(DEVICES)), put(self.mesh, y, P(DEVICES))
        self.params, self.state = jax.block_until_ready(prog(self.params, self.state, xs, ys))


def compress(**kwargs):
    """``loco.compress`` of LoCo's settings given together (a parametrized case's dict): those that describe
    what is sent build ``loco.codec(...)``, the rest are ``compress``'s own."""
    codec_names = inspect.signature(loco.codec).parameters
    codec = loco.codec(**{k: v for k, v in kwargs.items() if k in codec_names})
    return loco.compress(codec, **{k: v for k, v in kwargs.items() if k not in codec_names})


def inner_sgd(lr):
    return optax.chain(loco.compress(bits=None, axis_name="data"), optax.sgd(lr))


def inner_adamw():
    return optax.chain(loco.compress(bits=None, axis_name="data"), optax.adamw(0.02, b1=0.9, b2=0.95, weight_decay=0.1))


def plain_sgd_outer():
    return optax.sgd(1.0)


def plain_inner(xs, ys, steps, tx):
    """The inner optimizer alone on replica 0's data (full batch of its D devices)."""
    params = make_params()
    state = tx.init(params)
    for t in range(1, steps + 1):
        x, y = xs[t - 1][: D * BATCH], ys[t - 1][: D * BATCH]
        updates, state = tx.update(jax.grad(loss_fn)(params, x, y), state, params)
        params = optax.apply_updates(params, updates)
    return params


class Island:
    """One island of the (2, 4) mesh's DiLoCo run: replica ``r`` as a job of its own (a ``data`` mesh of 4
    devices, no replica axis), its payloads handed to the other islands by the host. The islands of one test
    share their devices and compiled ``programs`` (they run one after the other here)."""

    def __init__(self, tx, r, devices, programs):
        self.tx, self.r = tx, r
        self.mesh = jax.make_mesh((len(devices),), ("data",), devices=devices)
        self.params = put(self.mesh, make_params(), P())
        self.specs = diloco.state_specs(tx, self.params, self.mesh, in_specs=P())
        self.state = jax.jit(jax.shard_map(tx.init, mesh=self.mesh, in_specs=P(), out_specs=self.specs))(self.params)
        self.programs = programs

    def body(self, params, state, x, y, inbox, phase):
        grads = jax.grad(loss_fn)(jax.lax.pcast(params, "data", to="varying"), x, y)
        updates, state = self.tx.update(grads, state, params, phase=phase, inbox=inbox)
        return jax.tree.map(lambda a, b: a + b, params, updates), state

    def step(self, t, x, y, inbox):
        ph = self.tx.phase(t)
        if ph not in self.programs:
            fn = lambda *a, ph=ph: self.body(*a, phase=ph)
            self.programs[ph] = jax.jit(jax.shard_map(
                fn, mesh=self.mesh, in_specs=(P(), self.specs, P("data"), P("data"), P(None, "data")),
                out_specs=(P(), self.specs)))
        put_rows = lambda a: put(self.mesh, a, P("data"))
        self.params, self.state = jax.block_until_ready(self.programs[ph](
            self.params, self.state, put_rows(x), put_rows(y), put(self.mesh, inbox, P(None, "data"))))

    def payload(self, p):
        """This island's payload of fragment ``p``: each data device's head of its outbox, ``(D, bytes)``."""
        d = self.mesh.shape["data"]
        nb = self.tx.payload_bytes(jax.tree.map(np.asarray, self.params), p, d)
        return np.asarray(self.state.outbox).reshape(d, -1)[:, :nb]
