"""The device mesh (``replica``, ``data``, optionally ``local``) and multi-host start-up.

Axis order is ``(replica, data)`` or ``(replica, data, local)``: ``local`` splits the data devices
into hosts x the devices of one host (hierarchical LoCo runs its exact stage over it). Devices are
laid out host-major: with several processes, the devices of one process
fill whole rows of the ``replica`` axis, so the collectives inside a replica
(``data``: LoCo's gradient all-reduce, the all-gather of outer-gradient
slices) stay on a host's fast links and only DiLoCo's outer exchange crosses
hosts.

Multi-host start-up (:func:`initialize`) reads the coordinator address, the
number of processes and this process's id from its arguments or from the
environment (``LOCO_JAX_COORDINATOR``, ``LOCO_JAX_NUM_PROCESSES``,
``LOCO_JAX_PROCESS_ID``; JAX's own ``JAX_COORDINATOR_ADDRESS``,
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` are read too), and calls
``jax.distributed.initialize``. On CPU it selects gloo collectives, so a
multi-process run works on one machine over localhost.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from loco_jax.checks import require_int

AXES = ("replica", "data")
AXES_LOCAL = ("replica", "data", "local")

_ENV = {
    "coordinator_address": ("LOCO_JAX_COORDINATOR", "JAX_COORDINATOR_ADDRESS"),
    "num_processes": ("LOCO_JAX_NUM_PROCESSES", "JAX_NUM_PROCESSES"),
    "process_id": ("LOCO_JAX_PROCESS_ID", "JAX_PROCESS_ID"),
}


def _from_env(name):
    for var in _ENV[name]:
        if os.environ.get(var):
            return os.environ[var]
    return None


def distributed_settings(coordinator_address=None, num_processes=None, process_id=None):
    """Resolved multi-host settings (arguments first, then the environment), or None for one process."""
    address = coordinator_address or _from_env("coordinator_address")
    count = num_processes if num_processes is not None else _from_env("num_processes")
    index = process_id if process_id is not None else _from_env("process_id")
    if address is None and count is None and index is None:
        return None
    missing = [n for n, v in (("coordinator address", address), ("process count", count), ("process id", index)) if v is None]
    if missing:
        raise ValueError(
            f"multi-host start-up needs the coordinator address, the process count and this process's id; missing: "
            f"{', '.join(missing)}. Pass --coordinator/--num-processes/--process-id or set "
            "LOCO_JAX_COORDINATOR, LOCO_JAX_NUM_PROCESSES and LOCO_JAX_PROCESS_ID."
        )
    try:
        count, index = int(count), int(index)
    except ValueError:
        raise ValueError(f"process count {count!r} and process id {index!r} must be integers.") from None
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"process id {index} must lie in [0, {count}) and the process count must be >= 1.")
    return {"coordinator_address": address, "num_processes": count, "process_id": index}


HEARTBEAT_TIMEOUT = 60  # seconds; jax's own default is 100


def initialize(coordinator_address=None, num_processes=None, process_id=None, *, local_device_count=None,
               heartbeat_timeout=HEARTBEAT_TIMEOUT):
    """Starts ``jax.distributed`` when settings are given; returns them (None: single process).

    Call before any other jax API that touches devices. ``local_device_count``
    forces that many CPU devices per process (simulated hosts).

    ``heartbeat_timeout``: seconds without a heartbeat after which the coordination service declares a
    process dead. Heartbeats come from a runtime thread of their own (compiling or a long step does not
    delay them), so only a dead process or a lost network misses them; 60 s reports a dead peer on a pod
    within about a minute where a collective does not raise first (NCCL waits instead) and leaves room
    for a network blip. When it reports a dead process, jax's runtime aborts every other process (a fatal
    error with a C++ stack trace; its Python callback for this is not usable in jaxlib 0.10):
    :func:`loco_jax.training.run.failure.supervise` turns that into one message and exit status 75.
    """
    require_int("heartbeat_timeout", heartbeat_timeout, "a whole number of seconds >= 1")
    settings = distributed_settings(coordinator_address, num_processes, process_id)
    if local_device_count is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_device_count}".strip()
    if settings is None:
        return None
    if os.environ.get("JAX_PLATFORMS", "cpu").startswith("cpu") or not os.environ.get("JAX_PLATFORMS"):
        # CPU processes exchange over gloo; GPU backends ignore this setting.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(**settings, heartbeat_timeout_seconds=heartbeat_timeout)
    return settings


def make_mesh(replicas: int = 1, data: int | None = None, local: int = 1, devices=None) -> jax.sharding.Mesh:
    """A ``(replica, data)`` (or ``(replica, data, local)``) mesh over all devices, host-major.

    ``data=None`` takes every device not used by the other axes. ``local > 1`` adds the ``local`` axis
    of consecutive devices (those of one host). Raises a ``ValueError`` naming the sizes when they do
    not match the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    for name, value in (("replicas", replicas), ("local", local)):
        require_int(f"mesh.{name}", value)
    if data is None:
        if n % (replicas * local):
            sizes = f"mesh.replicas={replicas}" + (f" x mesh.local={local}" if local > 1 else "")
            raise ValueError(f"{sizes} does not divide the {n} devices; choose sizes whose product divides {n}.")
        data = n // (replicas * local)
    require_int("mesh.data", data)
    if replicas * data * local != n:
        raise ValueError(
            f"mesh (replica={replicas}, data={data}, local={local}) needs {replicas * data * local} devices, but "
            f"{n} are visible ({jax.process_count()} process(es) x {jax.local_device_count()} local). Choose sizes "
            f"whose product is {n}, or set mesh.data to None to use every remaining device."
        )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    if local == 1:
        grid, names = np.array(ordered, dtype=object).reshape(replicas, data), AXES
    else:
        grid, names = np.array(ordered, dtype=object).reshape(replicas, data, local), AXES_LOCAL
    types = (jax.sharding.AxisType.Explicit,) * len(names)
    return jax.sharding.Mesh(grid, names, axis_types=types)


def replicas_per_host(mesh) -> dict:
    """{process index: [replica indices whose devices it holds]}: for logs and checks."""
    out = {}
    grid = np.asarray(mesh.devices)
    for r in range(grid.shape[0]):
        for proc in sorted({d.process_index for d in grid[r].reshape(-1)}):
            out.setdefault(proc, []).append(r)
    return out


def describe(mesh) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in mesh.shape.items())
    hosts = replicas_per_host(mesh)
    split = [r for r in range(mesh.shape["replica"]) if sum(r in v for v in hosts.values()) > 1]
    note = f"; replicas split across hosts: {split}" if split else ""
    return f"mesh ({shape}) on {math.prod(mesh.shape.values())} devices, {jax.process_count()} process(es){note}"
