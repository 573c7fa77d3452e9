"""GPU check: step time and MFU of a model with and without LoCo compression, and the kernels alone.

Single device, synthetic tokens, no network: made for the lent H200 (jax 0.11.2
preinstalled, run with ``PYTHONPATH=.``), testable on CPU with ``--model tiny``.

    OUT=/tmp/out PYTHONPATH=. python benchmarks/gpu_check.py --model 1b --batch 8 --seq 2048
    python benchmarks/gpu_check.py --model tiny --batch 4 --seq 64 --steps 3     # CPU smoke test

Measures, side by side in one process:
- step time of ``loss -> grad -> AdamW`` and of ``loss -> grad -> loco.compress(axis_name=None)
  -> AdamW`` (quantize, pack, unpack, error update: everything but the network);
- model FLOPs utilisation: 6 * params * tokens (+ attention 12 * L * T^2 * d per sequence)
  per step against the peak (989 TFLOP/s dense bf16 for an H200; ~790 is what dense
  matmuls reach in practice);
- the time of ``quant.encode`` + ``quant.decode`` alone on a parameter-sized vector;
- on a GPU, the plain step with XLA's attention and with cuDNN's fused attention (the trainer's
  ``model.attention="auto"`` on GPUs): step time, temporaries, and the cuDNN kernel in the program.
Writes ``gpu_check.json`` under ``--out`` (default ``$OUT``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from loco_jax import loco, quant  # noqa: E402
from loco_jax.training import model as model_lib  # noqa: E402

H200_PEAK = 989e12
H200_PRACTICAL = 790e12


def timed(fn, *args, steps):
    """Median seconds per call after two warm-up calls; ``fn`` returns its new first args."""
    out = args
    for _ in range(2):
        out = jax.block_until_ready(fn(*out))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*out))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def make_step(cfg, tx):
    @jax.jit
    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(model_lib.loss_fn, argnums=1)(cfg, params, tokens[:, :-1], tokens[:, 1:])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, tokens

    return step


def measure(model, batch, seq, steps, bits):
    """Step time with and without ``loco.compress(axis_name=None)`` and the codec alone, for one model."""
    cfg = model_lib.CONFIGS[model].replace(remat=model == "1b", max_seq_len=max(seq, 8))
    n_params = model_lib.count_params(cfg)
    device = jax.devices()[0]
    print(f"{model}: {n_params:,} parameters on {device.device_kind} ({jax.default_backend()}), jax {jax.__version__}",
          flush=True)
    params = model_lib.init_params(cfg, jax.random.PRNGKey(0))
    tokens = jax.random.randint(jax.random.PRNGKey(1), (batch, seq + 1), 0, cfg.vocab_size, jnp.int32)
    tokens_per_step = batch * seq
    flops = 6 * n_params * tokens_per_step + 12 * cfg.num_layers * seq**2 * cfg.d_model * batch

    results = {"model": model, "params": n_params, "device": device.device_kind, "backend": jax.default_backend(),
               "jax": jax.__version__, "batch": batch, "seq": seq, "flops_per_step": flops}
    for name, tx in (
        ("adamw", optax.adamw(3e-4)),
        (f"loco{bits}+adamw", optax.chain(loco.compress(bits=bits, axis_name=None), optax.adamw(3e-4))),
    ):
        opt_state = tx.init(params)
        t_compile = time.perf_counter()
        step = make_step(cfg, tx)
        step.lower(params, opt_state, tokens).compile()
        compile_s = time.perf_counter() - t_compile
        median, times = timed(step, params, opt_state, tokens, steps=steps)
        results[name] = {
            "step_s": median, "all_steps_s": times, "compile_s": compile_s,
            "tokens_per_s": tokens_per_step / median, "tflops": flops / median / 1e12,
            "mfu_vs_989": flops / median / H200_PEAK, "mfu_vs_790": flops / median / H200_PRACTICAL,
        }
        print(f"  {name}: {median * 1e3:.1f} ms/step, {flops / median / 1e12:.2f} TFLOP/s "
              f"(MFU {100 * flops / median / H200_PEAK:.1f} % of 989)", flush=True)
    if jax.default_backend() == "gpu":  # the fused attention the trainer's model.attention="auto" takes on GPUs
        results["attention"] = attention_check(cfg, params, tokens, steps, flops)
    base, comp = results["adamw"]["step_s"], results[f"loco{bits}+adamw"]["step_s"]
    results["compression_overhead"] = comp / base - 1
    results["compression_share_of_compressed_step"] = (comp - base) / comp

    flat = jnp.zeros((1, -(-n_params // 256) * 256), jnp.float32) + 0.5
    codec = jax.jit(lambda x: quant.decode(quant.encode(x, bits), bits, cols=x.shape[1]))
    codec.lower(flat).compile()
    median, _ = timed(lambda x: (codec(x),), flat, steps=steps)
    results["encode_decode_s"] = median
    results["encode_decode_share_of_step"] = median / base
    print(f"  encode+decode of {n_params:,} values at {bits} bits: {median * 1e3:.1f} ms "
          f"({100 * median / base:.1f} % of the plain step); compression overhead in the step "
          f"{100 * results['compression_overhead']:.1f} %", flush=True)
    return results


def attention_check(cfg, params, tokens, steps, flops):
    """The plain AdamW step with XLA's attention and with cuDNN's fused one, side by side: step time, the
    GPU compiler's temporaries, and whether the compiled program calls cuDNN's attention kernel."""
    out = {}
    tx = optax.adamw(3e-4)
    for impl in ("xla", "cudnn"):
        step = make_step(cfg.replace(attention_impl=None if impl == "xla" else impl), tx)
        opt_state = tx.init(params)
        compiled = step.lower(params, opt_state, tokens).compile()
        median, _ = timed(step, params, opt_state, tokens, steps=steps)
        mem = compiled.memory_analysis()
        out[impl] = {"step_s": median, "tflops": flops / median / 1e12, "cudnn_kernel": "cudnn" in compiled.as_text(),
                     "temp_bytes": int(mem.temp_size_in_bytes) if mem else None}
        print(f"  attention {impl}: {median * 1e3:.1f} ms/step, temporaries "
              f"{out[impl]['temp_bytes'] / 2**30 if mem else float('nan'):.2f} GiB, cuDNN kernel in the program: "
              f"{out[impl]['cudnn_kernel']}", flush=True)
    out["cudnn_speedup"] = out["xla"]["step_s"] / out["cudnn"]["step_s"]
    return out


def table(all_results, bits):
    lines = [
        f"| model | params | batch x seq | plain step | with LoCo {bits}-bit | compression share of the compressed step "
        "| encode + decode alone | TFLOP/s (plain) | MFU vs 989 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in all_results:
        plain, comp = r["adamw"], r[f"loco{bits}+adamw"]
        lines.append(
            f"| {r['model']} | {r['params']:,} | {r['batch']} x {r['seq']} | {plain['step_s'] * 1e3:.1f} ms | "
            f"{comp['step_s'] * 1e3:.1f} ms ({comp['step_s'] / plain['step_s']:.2f}x) | "
            f"{100 * r['compression_share_of_compressed_step']:.1f} % | {r['encode_decode_s'] * 1e3:.1f} ms "
            f"({100 * r['encode_decode_share_of_step']:.1f} % of the plain step) | {plain['tflops']:.2f} | "
            f"{100 * plain['mfu_vs_989']:.2f} % |"
        )
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="1b", help="one or more of " + ", ".join(sorted(model_lib.CONFIGS)) + ", comma-separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_check"))
    ap.add_argument("--write-results", action="store_true", help="also put the table into docs/results.md")
    args = ap.parse_args()
    models = args.model.split(",")
    unknown = [m for m in models if m not in model_lib.CONFIGS]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {sorted(model_lib.CONFIGS)}")
    all_results = [measure(m, args.batch, args.seq, args.steps, args.bits) for m in models]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
        json.dump(all_results if len(all_results) > 1 else all_results[0], f, indent=2)
    print(f"wrote {os.path.join(args.out, 'gpu_check.json')}")
    text = table(all_results, args.bits)
    print(text)
    if args.write_results:
        from benchmarks import common

        heading = f"## Compression overhead on {jax.default_backend().upper()} (benchmarks/gpu_check.py)"
        body = (f"One device, synthetic tokens; median of {args.steps} steps after two warm-up steps, the two "
                "variants compiled and timed one after the other in one process. The compressed step runs "
                f"`loco.compress(bits={args.bits}, axis_name=None)` before AdamW: quantize, pack, unpack and the "
                "error update, everything but the network. MFU counts 6 x params x tokens plus attention against "
                "an H200's 989 TFLOP/s (790 is what dense matmuls reach in practice); on CPU it only shows how far "
                "a CPU is from that.\n\n" + text)
        common.write_section(heading, body, extra_args=sys.argv[1:])


if __name__ == "__main__":
    main()
