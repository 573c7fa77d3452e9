"""Deterministic, restartable batches of a token stream, and the fixed evaluation windows.

Batches
=======
The token stream of a split has ``N`` tokens. A sample is a window of
``seq_len + 1`` tokens (inputs are its first ``seq_len`` tokens, targets its
last ``seq_len``). Each epoch has ``W = (N - 1) // seq_len`` non-overlapping
windows. Global sample ``i`` belongs to epoch ``e = i // W`` and starts at::

    start(i) = offset(seed, e) + perm(seed, e)[i % W] * seq_len

where ``perm(seed, e)`` is a bijection of ``[0, W)`` (a keyed 6-round Feistel
network with cycle walking, pure integer arithmetic, so it does not depend on
the NumPy version) and ``offset(seed, e)`` is in ``[0, N - 1 - W * seq_len]``
(moves the window grid between epochs). Every epoch therefore visits each of
its ``W`` windows exactly once, and the batch depends on nothing but
``(tokens, seq_len, seed, i)``.

Global step ``s`` reads samples ``[s * B, (s + 1) * B)`` for a global batch
``B``. The rows of a global batch are laid out replica-major, then data
device: with ``R`` replicas of ``D`` data devices and ``b = B / (R * D)``
rows per device, row ``j`` goes to replica ``j // (D * b)``, data device
``(j // b) % D``, i.e. device ``k = r * D + d`` holds rows
``[k * b, (k + 1) * b)`` (:func:`device_slices`). This is the layout of a
``jax.sharding.NamedSharding(mesh, P(("replica", "data")))`` on the batch
axis. The position of a :class:`Batcher` is a single integer (the next global
sample index), so a run restarts on any number of devices or hosts and reads
exactly the same samples.

Multi-host: each process calls ``next_batch(B, process_index=p,
num_processes=P)`` and gets only its rows ``[p * B / P, (p + 1) * B / P)``
(the mesh is host-major: a process's devices are consecutive in the layout
above), ready for ``jax.make_array_from_process_local_data``; every process
advances its position by the full ``B``.

Evaluation uses a fixed set of windows: the first ``n`` non-overlapping
windows of the eval stream (``start = k * seq_len``), independent of seed,
step and device count (:func:`eval_windows`, :func:`iter_eval_batches`).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


_M64 = (1 << 64) - 1
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_FEISTEL_ROUNDS = 6


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _C1
        x = (x ^ (x >> np.uint64(27))) * _C2
    return x ^ (x >> np.uint64(31))


def _epoch_key(seed: int, epoch: int) -> np.uint64:
    s = np.array([seed & _M64], dtype=np.uint64)
    e = np.array([epoch & _M64], dtype=np.uint64)
    with np.errstate(over="ignore"):
        return _mix64(_mix64(s + _GOLDEN) ^ (e * _GOLDEN + np.uint64(1)))[0]


def _permute(idx: np.ndarray, n: int, key: np.uint64) -> np.ndarray:
    """A keyed bijection of ``[0, n)`` applied to ``idx`` (Feistel network on 2h bits + cycle walking)."""
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    h = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    with np.errstate(over="ignore"):
        keys = _mix64(np.uint64(key) + np.arange(1, _FEISTEL_ROUNDS + 1, dtype=np.uint64) * _GOLDEN)

    def rounds(x):
        left, right = x >> h, x & mask
        for k in keys:
            left, right = right, left ^ (_mix64(right ^ k) & mask)
        return (left << h) | right

    x = rounds(np.asarray(idx, dtype=np.uint64))
    bad = x >= np.uint64(n)
    while bad.any():
        x[bad] = rounds(x[bad])
        bad = x >= np.uint64(n)
    return x.astype(np.int64)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows per epoch: ``(num_tokens - 1) // seq_len``; raises if the stream is too short for one."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
    w = (int(num_tokens) - 1) // seq_len
    if w < 1:
        raise ValueError(f"a token stream of {num_tokens} tokens is too short for one window of seq_len + 1 = "
                         f"{seq_len + 1} tokens.")
    return w


def sample_starts(num_tokens: int, samples, *, seq_len: int, seed: int) -> np.ndarray:
    """Start positions (int64) of the windows of global sample indices ``samples`` (module docstring)."""
    samples = np.asarray(samples, dtype=np.int64)
    if samples.size and samples.min() < 0:
        raise ValueError("sample indices must be >= 0.")
    w = num_windows(num_tokens, seq_len)
    slack = (int(num_tokens) - 1) - w * seq_len
    epochs, within = np.divmod(samples, w)
    starts = np.empty(samples.shape, dtype=np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        key = _epoch_key(int(seed), int(e))
        offset = int(_mix64(np.array([key ^ _C2]))[0] % np.uint64(slack + 1))
        starts[sel] = offset + _permute(within[sel], w, key) * seq_len
    return starts


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int, announce: bool = True):
    if len(starts) == 0:
        empty = np.zeros((0, seq_len), np.int32)
        return empty, empty.copy()
    take = getattr(tokens, "windows", None)  # token shards read each window as slices of its shard(s)
    if take is not None:
        windows = take(starts, seq_len + 1, announce=announce).astype(np.int32)
    else:
        windows = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)]).astype(np.int32)
    return windows[:, :-1], windows[:, 1:]


def batch(tokens: np.ndarray, *, first_sample: int, num_samples: int, seq_len: int, seed: int):
    """(inputs, targets), int32 ``[num_samples, seq_len]``, of global samples ``[first_sample, first_sample + n)``."""
    if num_samples < 0 or first_sample < 0:
        raise ValueError("first_sample and num_samples must be >= 0.")
    samples = np.arange(first_sample, first_sample + num_samples, dtype=np.int64)
    return _gather(tokens, sample_starts(len(tokens), samples, seq_len=seq_len, seed=seed), seq_len)


def device_slices(global_batch: int, num_replicas: int, per_replica_devices: int) -> list[list[slice]]:
    """``out[r][d]``: the rows of a global batch held by replica ``r``, data device ``d``.

    Replica-major then data device: with ``b = global_batch // (num_replicas * per_replica_devices)``,
    device ``k = r * per_replica_devices + d`` holds rows ``[k * b, (k + 1) * b)`` (sample ``j`` of a step
    goes to device ``j // b``), as ``NamedSharding(mesh, P(("replica", "data")))`` lays out dim 0.
    """
    devices = num_replicas * per_replica_devices
    if num_replicas < 1 or per_replica_devices < 1:
        raise ValueError("num_replicas and per_replica_devices must be >= 1.")
    if global_batch % devices:
        raise ValueError(f"global batch {global_batch} is not divisible by {num_replicas} replicas x "
                         f"{per_replica_devices} devices = {devices}.")
    b = global_batch // devices
    return [[slice((r * per_replica_devices + d) * b, (r * per_replica_devices + d + 1) * b)
             for d in range(per_replica_devices)] for r in range(num_replicas)]


def process_rows(global_batch: int, process_index: int = 0, num_processes: int = 1) -> slice:
    """Rows of a global batch that process ``process_index`` of ``num_processes`` reads (host-major mesh)."""
    if num_processes < 1 or not 0 <= process_index < num_processes:
        raise ValueError(f"process_index {process_index} must lie in [0, {num_processes}).")
    if global_batch % num_processes:
        raise ValueError(f"global batch {global_batch} is not divisible by {num_processes} processes.")
    per = global_batch // num_processes
    return slice(process_index * per, (process_index + 1) * per)


class Batcher:
    """Reads consecutive global batches of a token stream; its position is one integer.

    ``next_batch(B)`` returns global samples ``[pos, pos + B)`` (or this process's rows of them) and
    advances ``pos`` by ``B``. ``state()`` is ``{"next_sample", "seq_len", "seed", "num_tokens"}``
    (JSON-serializable; token shards add ``"fingerprint"``, a digest of their files' names, sizes and
    SHA-256s); ``restore`` checks that the others match, so a restart reads the same samples whatever the
    device or process count, and refuses shards re-made with other contents.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, seed: int = 0, next_sample: int = 0):
        self.tokens = tokens
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.windows_per_epoch = num_windows(len(tokens), self.seq_len)
        if next_sample < 0:
            raise ValueError("next_sample must be >= 0.")
        self.next_sample = int(next_sample)
        self._announced = None  # ((first sample, count), starts) of the rows the last next_batch announced

    @property
    def epoch(self) -> float:
        """Epochs completed so far (fractional)."""
        return self.next_sample / self.windows_per_epoch

    def read(self, first_sample: int, num_samples: int):
        """(inputs, targets) of global samples ``[first_sample, first_sample + num_samples)``; no state change."""
        return batch(self.tokens, first_sample=first_sample, num_samples=num_samples, seq_len=self.seq_len,
                     seed=self.seed)

    def next_batch(self, global_batch: int, *, process_index: int = 0, num_processes: int = 1):
        """(inputs, targets) int32 ``[global_batch // num_processes, seq_len]``: this process's rows of the
        next global batch (all of it with one process); the position advances by ``global_batch``.

        Over token shards the rows of the batch after it are announced to the kernel before returning
        (``ShardedTokens.prefetch``), so their reads from storage overlap the step that uses this one.
        """
        if global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {global_batch}.")
        rows = process_rows(global_batch, process_index, num_processes)
        first, count = self.next_sample + rows.start, rows.stop - rows.start
        announced = self._announced is not None and self._announced[0] == (first, count)
        starts = self._announced[1] if announced else self._starts(first, count)
        out = _gather(self.tokens, starts, self.seq_len, announce=not announced)
        self.next_sample += global_batch
        self._announced = None
        prefetch = getattr(self.tokens, "prefetch", None)  # token shards: start reading the next batch's rows
        if prefetch is not None:
            first = self.next_sample + rows.start
            starts = self._starts(first, count)
            prefetch(starts, self.seq_len + 1)
            self._announced = ((first, count), starts)
        return out

    def _starts(self, first: int, count: int) -> np.ndarray:
        return sample_starts(len(self.tokens), np.arange(first, first + count), seq_len=self.seq_len, seed=self.seed)

    def state(self) -> dict:
        out = {"next_sample": self.next_sample, "seq_len": self.seq_len, "seed": self.seed,
               "num_tokens": int(len(self.tokens))}
        fingerprint = getattr(self.tokens, "fingerprint", None)
        if fingerprint:
            out["fingerprint"] = fingerprint
        return out

    def restore(self, state: dict) -> "Batcher":
        for key, mine in (("seq_len", self.seq_len), ("seed", self.seed), ("num_tokens", len(self.tokens))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"data state was saved with {key}={state[key]}, this batcher has {key}={mine}; "
                                 "restoring it would read different samples.")
        mine = getattr(self.tokens, "fingerprint", None)
        if "fingerprint" in state and mine and state["fingerprint"] != mine:
            raise ValueError(
                f"data state was saved over token shards with fingerprint {state['fingerprint']}, these shards have "
                f"{mine}: the shard files changed (re-made with other contents?), so restoring would read different "
                "samples. Point data.path at the shards the run started with, or start a new --workdir."
            )
        nxt = int(state["next_sample"])
        if nxt < 0:
            raise ValueError("next_sample must be >= 0.")
        self.next_sample = nxt
        return self


def eval_windows(tokens: np.ndarray, *, seq_len: int, max_windows: int | None = None):
    """(inputs, targets) of the first ``min(max_windows, (N - 1) // seq_len)`` non-overlapping windows."""
    n = num_windows(len(tokens), seq_len)
    if max_windows is not None:
        n = min(n, int(max_windows))
    return _gather(tokens, np.arange(n, dtype=np.int64) * seq_len, seq_len)


def iter_eval_batches(
    tokens: np.ndarray, *, seq_len: int, batch_size: int, max_windows: int | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Batches ``(inputs, targets, weights)`` of :func:`eval_windows`, each ``batch_size`` rows; the last one is
    padded with zero rows of weight 0, so every batch has the same shape and the weighted mean over all
    batches is the same whatever ``batch_size``."""
    inputs, targets = eval_windows(tokens, seq_len=seq_len, max_windows=max_windows)
    for i in range(0, len(inputs), batch_size):
        x, y = inputs[i : i + batch_size], targets[i : i + batch_size]
        w = np.ones((len(x),), np.float32)
        if len(x) < batch_size:
            pad = batch_size - len(x)
            x = np.concatenate([x, np.zeros((pad, seq_len), np.int32)])
            y = np.concatenate([y, np.zeros((pad, seq_len), np.int32)])
            w = np.concatenate([w, np.zeros((pad,), np.float32)])
        yield x, y, w
