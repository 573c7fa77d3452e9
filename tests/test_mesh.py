"""Mesh construction and multi-host settings."""

import jax
import pytest

from loco_jax.training.run import mesh as mesh_lib


def test_mesh_axes_and_host_major_layout():
    m = mesh_lib.make_mesh(replicas=2)
    assert dict(m.shape) == {"replica": 2, "data": 4}
    assert [d.id for d in m.devices[0]] == [0, 1, 2, 3]
    assert mesh_lib.replicas_per_host(m) == {0: [0, 1]}
    h = mesh_lib.make_mesh(data=2, local=4)  # 2 hosts x 4 devices: a host's devices on the local axis
    assert dict(h.shape) == {"replica": 1, "data": 2, "local": 4}
    assert [d.id for d in h.devices[0, 1]] == [4, 5, 6, 7]
    assert "replica=2" in mesh_lib.describe(m)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(replicas=3), "does not divide the 8 devices"),
        (dict(replicas=2, data=2), "needs 4 devices, but 8 are visible"),
        (dict(replicas=0), "replicas=0"),
        (dict(replicas=2, data=0), "data=0"),
        (dict(local=3), "mesh.local=3 does not divide the 8 devices"),
    ],
)
def test_bad_mesh_sizes_name_the_numbers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mesh_lib.make_mesh(**kwargs)


def test_distributed_settings(monkeypatch):
    for var in ("LOCO_JAX_COORDINATOR", "LOCO_JAX_NUM_PROCESSES", "LOCO_JAX_PROCESS_ID",
                "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert mesh_lib.distributed_settings() is None
    monkeypatch.setenv("LOCO_JAX_COORDINATOR", "localhost:1234")
    with pytest.raises(ValueError, match="process count, process id"):
        mesh_lib.distributed_settings()
    monkeypatch.setenv("LOCO_JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("LOCO_JAX_PROCESS_ID", "1")
    assert mesh_lib.distributed_settings() == {"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1}
    with pytest.raises(ValueError, match=r"process id 2 must lie in \[0, 2\)"):
        mesh_lib.distributed_settings(process_id=2)
    assert jax.process_count() == 1
