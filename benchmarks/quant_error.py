"""Relative error of one quantized all-reduce: Gaussian data and the project's real per-device gradients.

    python benchmarks/quant_error.py              # tables into docs/results.md, plot into docs/img/
    python benchmarks/quant_error.py --no-write   # print only

Real gradients: the quality benchmark's model and data (919k parameters,
16 x 64 bytes of Shakespeare per step over 8 devices, seed 0), trained with
the exact fp32 mean; at steps 1, 60 and 240 each of the 8 devices' own
gradient (before any reduction) is captured. Gaussian: each device holds
i.i.d. N(0, 1) values of the same size. For every format, bit width, rotation
and mode, ``collectives.quantized_pmean`` of the 8 gradients is compared with
the exact fp32 mean: ``|Q-mean - mean| / |mean|`` over the whole tree (one
bucket, block 256, no error feedback: the error a single step sends).

Floors for N(0, 1) blocks with ``D`` the quantizer's mean squared error per
unit variance (``quant.GAUSSIAN_MSE``): one quantization of each device's
values (all-gather) errs ``sqrt(D)`` relative to the sum of M independent
devices; the two-stage form quantizes each device's row (error ``M D``) and
then the reduced chunk again. An MSE-optimal quantizer's output is
uncorrelated with its error, so it carries ``1 - D`` of the input's energy:
the chunk has variance ``M (1 - D)``, its re-quantization adds ``M D (1 - D)``,
and the two errors are uncorrelated: ``sqrt(D (2 - D))`` in all (0.470 for
2-bit Lloyd-Max, whose ``D`` is 0.1175).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo root, not benchmarks/
from benchmarks import common  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HEADING = "## Single-step error of the quantized all-reduce (benchmarks/quant_error.py)"
CAPTURE_STEPS = (1, 60, 240)
# (label, bits, format, rotate)
VARIANTS = [
    ("int (absmax, reference)", 8, "int", False),
    ("int (absmax, reference)", 4, "int", False),
    ("e3m0 (reference)", 4, "e3m0", False),
    ("uniform", 4, "uniform", False),
    ("lloyd", 4, "lloyd", False),
    ("lloyd + rotation", 4, "lloyd", True),
    ("int + rotation", 4, "int", True),
    ("int (ternary, reference)", 2, "int", False),
    ("uniform", 2, "uniform", False),
    ("uniform + rotation", 2, "uniform", True),
    ("lloyd", 2, "lloyd", False),
    ("lloyd + rotation", 2, "lloyd", True),
    ("int (scaled sign, reference)", 1, "int", False),
    ("int + rotation", 1, "int", True),
]
MODES = ("two_stage", "all_gather")


def floor(fmt, bits, mode):
    """The N(0, 1) floor of the mode (see the module docstring); None where no Gaussian table applies."""
    d = quant_mse(fmt, bits)
    if d is None:
        return None
    return math.sqrt(d * (2 - d)) if mode == "two_stage" else math.sqrt(d)


def quant_mse(fmt, bits):
    from loco_jax import quant

    if fmt == "int" and bits == 1:
        fmt = "lloyd"  # the scaled sign is the 1-bit Lloyd-Max quantizer on a Gaussian block
    elif fmt == "int":
        return None
    return quant.GAUSSIAN_MSE.get((fmt, bits))


def capture_gradients():
    """{step: (8, n) per-device flat fp32 gradients} from the quality model trained at fp32."""
    from benchmarks import quality
    from loco_jax.training.run import config as config_lib
    from loco_jax.training import model as model_lib
    from loco_jax.training.run.steps import BATCH_SPEC, TrainState
    from loco_jax.training.run.trainer import Trainer

    cfg = config_lib.load(os.path.join(common.ROOT, "configs", "ddp.py"), quality.BASE + ["seed=0", "data.seed=0"])
    tr = Trainer(cfg, "/tmp/loco_jax_quant_error", log=lambda *_: None)
    state = tr.init_state()
    batches = tr.dataset.train_iterator(seed=cfg.data.seed)

    def local_grads(params, x, y):
        varying = lax.pcast(params, "data", to="varying")
        g = jax.grad(lambda p: model_lib.loss_fn(tr.mcfg, p, x, y))(varying)
        return jnp.concatenate([leaf.astype(jnp.float32).reshape(-1) for leaf in jax.tree.leaves(g)])[None]

    grads_fn = jax.jit(jax.shard_map(local_grads, mesh=tr.mesh, in_specs=(P(), BATCH_SPEC, BATCH_SPEC),
                                     out_specs=P(("replica", "data"))))
    out = {}
    for step in range(1, max(CAPTURE_STEPS) + 1):
        batch = tr.put_batch(batches.next_batch(cfg.batch_size))
        if step in CAPTURE_STEPS:
            out[step] = np.asarray(grads_fn(state.params, *batch))
        prog = tr.program(None, state, batch)
        params, opt_state, _ = prog(state.params, state.opt_state, *batch)
        state = TrainState(params, opt_state)
        jax.block_until_ready(state)
    return out


def errors(per_device, mesh):
    """{(bits, format, rotate, mode): relative L2 error} of one quantized mean of the (8, n) array."""
    from loco_jax import collectives

    x = jax.device_put(per_device, NamedSharding(mesh, P("data")))
    exact = per_device.astype(np.float64).mean(0)
    out = {}
    for _, bits, fmt, rot in VARIANTS:
        for mode in MODES:
            f = jax.jit(jax.shard_map(
                lambda v: collectives.quantized_pmean(v[0], "data", bits=bits, format=fmt, rotate=rot, mode=mode)[None],
                mesh=mesh, in_specs=P("data"), out_specs=P("data")))
            got = np.asarray(f(x))[0].astype(np.float64)
            out[(bits, fmt, rot, mode)] = float(np.linalg.norm(got - exact) / np.linalg.norm(exact))
    return out


def tables(gauss, real):
    lines = [
        "Relative L2 error of one `collectives.quantized_pmean` over 8 devices against the exact fp32 mean "
        "(block 256, one bucket, no error feedback). Floor: N(0, 1) blocks, `sqrt(D)` for one quantization "
        "(all-gather) and `sqrt(D (2 - D))` for two-stage (the re-quantized chunk holds `1 - D` of the energy), "
        "`D` the quantizer's Gaussian MSE (`quant.GAUSSIAN_MSE`). Real gradients: each device's own gradient of the quality model at steps "
        + ", ".join(map(str, CAPTURE_STEPS)) + " of an fp32 run (seed 0); the column is their mean, the ratio "
        "is that mean over the mode's Gaussian floor.",
        "",
    ]
    for mode in MODES:
        steps = sorted(real)
        lines += [
            f"### {mode.replace('_', '-')}",
            "",
            "| bits | format | Gaussian floor | Gaussian | " + " | ".join(f"real, step {s}" for s in steps)
            + " | real (mean) | real / floor |",
            "|---:|---|---:|---:|" + "---:|" * len(steps) + "---:|---:|",
        ]
        for label, bits, fmt, rot in VARIANTS:
            fl = floor(fmt, bits, mode)  # None for absmax int above 1 bit and e3m0: no Gaussian table
            vals = [real[s][(bits, fmt, rot, mode)] for s in steps]
            mean = float(np.mean(vals))
            lines.append(
                f"| {bits} | {label} | {f'{fl:.3f}' if fl else ''} | {gauss[(bits, fmt, rot, mode)]:.3f} | "
                + " | ".join(f"{v:.3f}" for v in vals) + f" | {mean:.3f} | " + (f"{mean / fl:.2f}" if fl else "") + " |"
            )
        lines.append("")
    return "\n".join(lines)


def plot(gauss, real):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for ax, mode in zip(axes, MODES):
        for label, fmt, rot, color in (("int absmax (reference)", "int", False, "tab:red"),
                                       ("lloyd + rotation (1 bit: sign + rotation)", "lloyd", True, "tab:green")):
            bits = [b for b in (1, 2, 4) if any(v[1] == b and v[2] == (fmt if b > 1 else "int") and v[3] == rot
                                                  for v in VARIANTS)]
            ys = [np.mean([real[s][(b, fmt if b > 1 else "int", rot, mode)] for s in real]) for b in bits]
            ax.plot(bits, ys, color=color, marker="o", label=f"{label}, real gradients")
            ax.plot(bits, [gauss[(b, fmt if b > 1 else "int", rot, mode)] for b in bits], color=color, marker="s",
                    linestyle=":", alpha=0.6, label=f"{label}, Gaussian")
        ax.plot([1, 2, 4], [floor("lloyd", b, mode) for b in (1, 2, 4)], "k-", lw=0.8, label="Gaussian floor")
        ax.set_xscale("log", base=2)
        ax.set_xticks([1, 2, 4], ["1", "2", "4"])
        ax.set_xlabel("bits per value")
        ax.set_title(f"one {mode.replace('_', '-')} all-reduce, 8 devices")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("relative L2 error vs exact mean")
    fig.tight_layout()
    path = os.path.join(common.ROOT, "docs", "img", "quant_error.png")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    start = time.perf_counter()
    cache = os.path.join(common.ROOT, "runs", "quant_error.npz")  # the captured gradients: a rerun skips training
    if os.path.exists(cache):
        real_grads = {int(k): v for k, v in np.load(cache).items()}
    else:
        real_grads = capture_gradients()
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        np.savez(cache, **{str(k): v for k, v in real_grads.items()})
    n = next(iter(real_grads.values())).shape[1]
    mesh = jax.make_mesh((8,), ("data",))
    gauss = errors(np.random.RandomState(0).randn(8, n).astype(np.float32), mesh)
    real = {s: errors(g, mesh) for s, g in real_grads.items()}
    print(tables(gauss, real), flush=True)
    png = plot(gauss, real)
    body = tables(gauss, real) + f"\n![single-step error]({os.path.relpath(png, os.path.dirname(common.RESULTS))})"
    common.report(HEADING, body + f"\n\n({time.perf_counter() - start:.0f} s)", no_write=args.no_write,
                  extra_args=[a for a in sys.argv[1:] if a != "--no-write"])


if __name__ == "__main__":
    main()
