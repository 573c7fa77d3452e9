"""Islands: replicas as separate JAX jobs that meet through JAX's transfer server.

In the mesh mode every replica is part of one ``jax.distributed`` job and the replicas' payloads cross the
``replica`` axis inside a step's program (:mod:`loco_jax.diloco`). An *island* is one replica run as a job of
its own; the islands share no job, no coordinator and no program. Each serves its payloads on a transfer
server (``jax.experimental.transfer``) and pulls its peers' from theirs, on the host's schedule, beside the
steps it keeps dispatching. For ``M`` islands, in round ``r`` of an exchange::

    island i offers p_i^r to every peer j          (one pull id per (r, i, j): each pull is served once)
    island i pulls  p_j^r from every peer j        (in the background; the bytes arrive while it computes)
    every island stacks [p_0^r, ..., p_{M-1}^r]    (island order: the same rows the mesh mode's all_gather holds)

and decodes the stack as the mesh mode does (:class:`loco_jax.diloco.Exchange`), so the mean is the same.

What the transfer server does not do, this module does: it refuses a malformed address before anything
starts; before the first round every pair of islands compares a *fingerprint* (the settings that must agree:
the model, H, the fragments, the exchange), and a mismatch is refused naming the peer and the settings that
differ; a pull that has not arrived by its deadline raises naming the late peers and their addresses (the
server's own pull waits forever on a peer that never answers). A :class:`Pending` round holds one result per
peer, so a round can be completed by fewer islands than started it (the elastic islands build on that).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FINGERPRINT_BYTES = 16384  # the handshake's payload: a JSON object of the settings that must agree, padded
HANDSHAKE_ROUND = -1  # the round number of the handshake's pulls (rounds of the exchange count from 0)
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


class IslandError(RuntimeError):
    """An island cannot go on: a peer is unreachable or late past a deadline, or runs other settings."""


def check_address(address: str, what: str = "address") -> str:
    """``address`` (``host:port``, ``[ipv6]:port``) as given, or a ValueError naming it and the form."""
    match = _ADDRESS.match(address) if isinstance(address, str) else None
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ValueError(f"{what} {address!r} is not host:port (a port in 1-65535), e.g. 127.0.0.1:7301 or "
                         "[::1]:7301.")
    return address


def pull_id(round_: int, sender: int, receiver: int, m: int) -> int:
    """The transfer server's id of the payload ``sender`` offers ``receiver`` in round ``round_`` (>= -1):
    distinct for every (round, sender, receiver) of ``m`` islands."""
    return ((round_ + 2) * m + sender) * m + receiver


class Pending(NamedTuple):
    """A round's pulls from the peers: ``arrays[j]`` is peer ``j``'s pytree (None for this island itself),
    arriving in the background. :meth:`wait` returns them once every byte is here."""

    round: int
    arrays: tuple
    addresses: tuple

    def ready(self) -> list[int]:
        """The peers whose payload has arrived."""
        return [j for j, x in enumerate(self.arrays)
                if x is not None and all(leaf.is_ready() for leaf in jax.tree.leaves(x))]

    def wait(self, timeout: float) -> tuple:
        """Every peer's payload, blocking at most ``timeout`` seconds; past it an :class:`IslandError` names
        the peers still missing (their index and address)."""
        expected = [j for j, x in enumerate(self.arrays) if x is not None]
        deadline = time.monotonic() + timeout
        while True:
            missing = sorted(set(expected) - set(self.ready()))
            if not missing:
                return self.arrays
            if time.monotonic() > deadline:
                late = ", ".join(f"island {j} at {self.addresses[j]}" for j in missing)
                raise IslandError(f"round {self.round}: no payload from {late} within {timeout:g} s; is it "
                                  "running, at that address, and in the same round?")
            time.sleep(0.002)


class Peers:
    """This island's transfer server and its connections to the other islands.

    ``index``: this island's number in ``addresses`` (one ``host:port`` per island, the same list on every
    island; this island serves on its own entry). ``fingerprint``: a JSON-able dict of the settings every
    island must share; :meth:`handshake` compares it with every peer's. ``device``: where pulled arrays land
    (default: this process's first device).
    """

    def __init__(self, index: int, addresses, *, fingerprint: dict | None = None, device=None):
        addresses = tuple(check_address(a, f"island address {k}") for k, a in enumerate(addresses))
        if not isinstance(index, int) or not 0 <= index < len(addresses):
            raise ValueError(f"island index {index!r} must be in [0, {len(addresses)}) for {len(addresses)} "
                             "island addresses.")
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"island addresses {list(addresses)} repeat one: each island needs its own.")
        from jax.experimental import transfer

        self.index, self.addresses, self.m = index, addresses, len(addresses)
        self.device = device or jax.local_devices()[0]
        self.fingerprint = dict(fingerprint or {})
        host = addresses[index].rsplit(":", 1)[0]
        self.server = transfer.start_transfer_server(self.device.client, addresses[index], [f"{host}:0"])
        self.connections = [None if j == index else self.server.connect(a) for j, a in enumerate(addresses)]

    @property
    def peers(self) -> list[int]:
        return [j for j in range(self.m) if j != self.index]

    def offer(self, round_: int, arrays) -> None:
        """Serve ``arrays`` (a pytree of arrays on this island's devices) to every peer for round ``round_``."""
        for j in self.peers:
            self.server.await_pull(pull_id(round_, self.index, j, self.m), arrays)

    def pull(self, round_: int, like) -> Pending:
        """Start pulling round ``round_``'s payload from every peer; ``like``: a pytree of
        ``jax.ShapeDtypeStruct`` (a sharding on this island's devices, or none: :attr:`device`)."""
        like = jax.tree.map(self._placed, like)
        arrays = tuple(None if conn is None else conn.pull(pull_id(round_, j, self.index, self.m), like)
                       for j, conn in enumerate(self.connections))
        return Pending(round_, arrays, self.addresses)

    def exchange(self, round_: int, arrays, timeout: float) -> list:
        """Offer ``arrays`` and pull every peer's of the same structure: the ``M`` payloads in island order
        (this island's own at its index), blocking at most ``timeout`` seconds."""
        like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), arrays)
        self.offer(round_, arrays)
        got = self.pull(round_, like).wait(timeout)
        return [arrays if j == self.index else got[j] for j in range(self.m)]

    def handshake(self, timeout: float = 60.0, linger: float = 5.0) -> None:
        """Every peer answers within ``timeout`` seconds with the same fingerprint, or an :class:`IslandError`
        names the peer (and the settings that differ). On a mismatch this island keeps serving its own
        fingerprint for ``linger`` seconds before it raises, so that the peer can pull it and name the
        mismatch too (the server cannot tell whether it was pulled)."""
        mine = _encode_fingerprint({"island": self.index, "islands": self.m, **self.fingerprint})
        got = self.exchange(HANDSHAKE_ROUND, jax.device_put(mine, self.device), timeout)
        try:
            self._compare(got)
        except IslandError:
            time.sleep(linger)
            raise

    def _compare(self, got):
        for j in self.peers:
            theirs = _decode_fingerprint(np.asarray(got[j]))
            if theirs.get("island") != j or theirs.get("islands") != self.m:
                raise IslandError(f"the peer at {self.addresses[j]} says it is island {theirs.get('island')} of "
                                  f"{theirs.get('islands')}; this island's list makes it island {j} of {self.m}. "
                                  "Give every island the same address list, in the same order.")
            differ = sorted(k for k in set(theirs) | set(self.fingerprint)
                            if k not in ("island", "islands") and theirs.get(k) != self.fingerprint.get(k))
            if differ:
                detail = "; ".join(f"{k}: {self.fingerprint.get(k)!r} here, {theirs.get(k)!r} there" for k in differ)
                raise IslandError(f"island {j} at {self.addresses[j]} runs other settings ({detail}); every island "
                                  "must run the same model, schedule and exchange.")

    def _placed(self, spec):
        sharding = getattr(spec, "sharding", None) or jax.sharding.SingleDeviceSharding(self.device)
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)


def _encode_fingerprint(fields: dict) -> np.ndarray:
    data = json.dumps(fields, sort_keys=True, default=str).encode()
    if len(data) > FINGERPRINT_BYTES - 4:
        raise ValueError(f"the islands' fingerprint is {len(data)} bytes of JSON; at most "
                         f"{FINGERPRINT_BYTES - 4} fit the handshake.")
    out = np.zeros(FINGERPRINT_BYTES, np.uint8)
    out[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
    out[4:4 + len(data)] = np.frombuffer(data, np.uint8)
    return out


def _decode_fingerprint(raw: np.ndarray) -> dict:
    n = int(np.frombuffer(raw[:4].tobytes(), np.uint32)[0])
    return json.loads(raw[4:4 + n].tobytes().decode())


def stack(payloads: list[Any]):
    """The ``M`` islands' payloads (pytrees of the same structure, in island order) stacked on a new axis 0:
    the rows the mesh mode's ``all_gather`` over ``replica`` holds."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *payloads)
