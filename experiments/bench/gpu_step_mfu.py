"""MFU of the RL update step on one GPU: a Qwen3-1.7B-shaped model, bf16 compute on fp32 master weights, cuDNN
flash attention, full remat, the fp32 chunked LM head (conf/model/qwen3_1_7b.yaml's options with cuDNN attention).

The step is ``make_train_step``'s jitted update (PPO-clip token-mean, clip_by_global_norm + AdamW) on random
weights and a random batch of full rows. Reported per row: step time (median of ``--steps`` after 2 warm-up
steps), tokens/s, model FLOPs per step, achieved TFLOP/s, and MFU against (a) the GPU's dense bf16 peak as its
vendor states it (``--peak-tflops``; H200 SXM: 989) and (b) a bf16 GEMM measured in the same run (an 8192^3
matmul in JAX). Model FLOPs = 6 N T (every weight, forward + backward) + 6 L B T^2 d_attn / 2 x 2 (causal
attention's two products, forward + backward); remat's recomputed forward is not counted (that is hardware
FLOPs, not model FLOPs). The device's peak memory in use is reported too.

    python experiments/bench/gpu_step_mfu.py [--batch 4 --seq 2048 --steps 10] [--out FILE.md]

It refuses to run without a GPU; ``--shape tiny --allow-cpu --attention dot_product_attention`` runs the same code
on a tiny shape on the CPU, to check the script itself (its numbers mean nothing).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import numpy as np

SHAPES = {
    # Qwen/Qwen3-1.7B (conf/model/qwen3_1_7b.yaml)
    "1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}


def model_flops(cfg: dict, n_params: int, b: int, t: int) -> float:
    """6 N T + causal attention (QK^T and PV, forward + backward: 3 x 2 x 2 B T^2 d_attn L / 2)."""
    d_attn = cfg["num_attention_heads"] * cfg["head_dim"]
    return 6 * n_params * b * t + 6 * b * t * t * d_attn * cfg["num_hidden_layers"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1.7b")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--attention", default="cudnn", help="model.options.attention (cudnn on a GPU)")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--compute-dtype", default="bfloat16")
    ap.add_argument("--logits-chunk", type=int, default=1024)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H200 SXM: 989)")
    ap.add_argument("--gemm-n", type=int, default=8192)
    ap.add_argument("--allow-cpu", action="store_true", help="run on the CPU (checks the script, not the numbers)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "gpu_step_mfu.md"))
    args = ap.parse_args()

    import jax
    from flax import nnx
    from train_step import gemm_peak  # experiments/bench/train_step.py: the same measured GEMM

    from jaxrl_term.model.qwen3 import ModelOptions, Qwen3, Qwen3Config
    from jaxrl_term.rl.batch import Batch
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step

    dev = jax.devices()[0]
    if dev.platform != "gpu" and not args.allow_cpu:
        raise SystemExit(f"no GPU: JAX's first device is {dev.platform} ({dev.device_kind}); this bench measures a "
                         "GPU (pass --allow-cpu with --shape tiny to check the script on a CPU)")
    cfg = SHAPES[args.shape]
    opts = ModelOptions(param_dtype="float32", compute_dtype=args.compute_dtype, remat=args.remat,
                        attention=args.attention, lm_head_fp32=True, logits_chunk=args.logits_chunk)
    model_cfg = Qwen3Config(**cfg, rope_theta=1e6)
    ts = make_train_step(model_cfg, AlgoConfig(eps_low=0.2, eps_high=0.28),
                         OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1.0), options=opts)
    model = Qwen3(model_cfg, opts, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    state = ts.init_state(params)
    del model, params

    b, t = args.batch, args.seq
    rng = np.random.RandomState(0)
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 4:] = 1.0  # a prompt quarter, then policy tokens
    rollout = np.where(mask > 0, np.log(rng.uniform(0.01, 0.5, (b, t))), 0.0).astype(np.float32)
    batch = Batch(tokens=rng.randint(0, cfg["vocab_size"], (b, t)).astype(np.int32),
                  positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)), segment_ids=np.ones((b, t), np.int32),
                  loss_mask=mask, advantages=np.repeat(rng.randn(b, 1), t, 1).astype(np.float32),
                  rollout_logp=rollout, old_logp=rollout, ref_logp=np.zeros_like(rollout),
                  fresh=np.ones_like(rollout))
    times = []
    t_compile = time.perf_counter()
    for i in range(args.steps + 2):
        t0 = time.perf_counter()
        state, metrics = ts(state, batch)  # metrics pulled to host: the step is complete
        jax.block_until_ready(state)
        if i == 0:
            t_compile = time.perf_counter() - t_compile
        if i >= 2:
            times.append(time.perf_counter() - t0)
    assert np.isfinite(metrics["loss"]), metrics
    step_s = statistics.median(times)
    flops = model_flops(cfg, n_params, b, t)
    achieved = flops / step_s / 1e12
    gemm_n = args.gemm_n if dev.platform == "gpu" else 1024
    gemm = gemm_peak(gemm_n, 20, "bfloat16") / 1e3  # TFLOP/s
    mem = (dev.memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30 if dev.platform == "gpu" else float("nan")

    header = ("| shape | params | batch x seq | attention | remat | step s | tokens/s | model TFLOP/step | TFLOP/s "
              "| MFU vs stated peak | MFU vs measured bf16 GEMM | measured GEMM TFLOP/s | peak memory GiB |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    row = (f"| {args.shape} | {n_params / 1e9:.2f}B | {b} x {t} | {args.attention} | {args.remat} | {step_s:.3f} | "
           f"{b * t / step_s:,.0f} | {flops / 1e12:.1f} | {achieved:.1f} | {100 * achieved / args.peak_tflops:.1f}% | "
           f"{100 * achieved / gemm:.1f}% | {gemm:.0f} | {mem:.1f} |")
    env = (f"jax {jax.__version__} on {dev.device_kind} ({dev.platform}), {platform.machine()}; fp32 master "
           f"weights, {args.compute_dtype} compute, fp32 LM head in chunks of {args.logits_chunk}; median of "
           f"{args.steps} steps after 2 warm-up steps (the first, with compilation, took {t_compile:.0f} s). Stated "
           f"peak: {args.peak_tflops:.0f} TFLOP/s dense bf16. Measured GEMM: a {gemm_n}^3 bf16 matmul in JAX. "
           "Model FLOPs: 6 N T + causal attention's products (forward + backward); remat's recomputation not "
           "counted.")
    text = (f"# RL update step MFU on one GPU (Qwen3-{args.shape} shape)\n\n{env}\n\n"
            f"Reproduce: `python experiments/bench/gpu_step_mfu.py --batch {b} --seq {t} --steps {args.steps}`\n\n"
            f"{header}\n{row}\n")
    print(text)
    if dev.platform == "gpu":
        Path(args.out).write_text(text)
        print(f"written to {args.out}")
    else:
        print("(CPU check run: nothing written)")


if __name__ == "__main__":
    main()
