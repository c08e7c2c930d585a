"""Update-step throughput: our jitted RL step vs a PyTorch eager reference, same model, loss and batch.

Ours: ``make_train_step`` (flax.nnx Qwen3, fp32 log-probs through the LM head, PPO-clip token-mean,
clip_by_global_norm + AdamW, one jax.jit). Peer, written here: transformers' Qwen3ForCausalLM + the same
PPO-clip token-mean loss on fp32 log-softmax + torch.nn.utils.clip_grad_norm_ + torch.optim.AdamW, eager.
Both fp32 on the same CPU threads and the same weights and batch.

Each side runs in its own subprocess (so each one's peak RSS is its own), alternating ours / peer for
``--rounds`` rounds of ``--steps`` timed steps after warm-up; tokens/s is the median over all timed steps.

    .venv/bin/python experiments/bench/train_step.py [--steps 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CONFIGS = {
    "tiny": dict(vocab_size=1024, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True),
    # Qwen3-0.6B's dimensions (conf/model/qwen3_0_6b.yaml), short context
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}
BATCH = {"tiny": (8, 256), "100m": (4, 256), "0.6b": (2, 128)}
# timed steps per worker at least (a tiny step is ~50 ms and this VM's bursts of noise last about as long as
# --steps of them: the median needs more samples there); rounds: minutes per step pair at 0.6B on 2 cores
MIN_STEPS = {"tiny": 40, "100m": 0, "0.6b": 0}
ROUNDS = {"tiny": None, "100m": None, "0.6b": 1}
# ours runs with the options of the model preset a user gets for that size (conf/model/NAME.yaml `options`);
# the 0.6B-shaped config with ModelOptions' defaults (its preset computes in bf16 with remat; this bench is fp32)
PRESET = {"tiny": "tiny", "100m": "bench_100m", "0.6b": None}
# ours with one ModelOptions field changed from that: what the option is worth (a row of its own)
VARIANTS = {"tiny": ["scan_layers=true", "attention=dot_product_attention"],
            "100m": ["scan_layers=true", "attention=dot_product_attention", "flat_matmuls=false"],
            "0.6b": ["scan_layers=false"]}
# an environment row: both sides without glibc's huge-page malloc (its worth; jaxrl_term/utils/hugepages.py)
NO_HUGEPAGES = "malloc huge pages off, both sides"
EPS_LOW, EPS_HIGH, LR = 0.2, 0.28, 1e-6


def make_data(name: str):
    b, t = BATCH[name]
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, CONFIGS[name]["vocab_size"], (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 4:] = 1.0  # a prompt quarter, then policy tokens
    rollout = np.where(mask > 0, np.log(rng.uniform(0.01, 0.5, (b, t))), 0.0).astype(np.float32)
    adv = np.repeat(rng.randn(b, 1), t, axis=1).astype(np.float32)
    return tokens, mask, rollout, adv


def preset_options(name: str) -> dict:
    """The ``options`` block of the config's model preset (conf/model/NAME.yaml), or {} (the defaults)."""
    if PRESET[name] is None:
        return {}
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[2] / "conf" / "model" / f"{PRESET[name]}.yaml"
    return dict(OmegaConf.to_container(OmegaConf.load(conf).options))


def parse_variant(variant: str) -> dict:
    """``field=value`` (a ModelOptions field, a YAML value) -> {field: value}; "" -> {}."""
    if not variant:
        return {}
    import yaml

    field, _, value = variant.partition("=")
    return {field: yaml.safe_load(value)}


def worker_ours(name: str, ckpt: str, steps: int, variant: str = "") -> list[float]:
    import jax
    from flax import nnx

    from jaxrl_term.model.hf import load_pretrained
    from jaxrl_term.model.qwen3 import ModelOptions
    from jaxrl_term.rl.batch import Batch
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step

    options = ModelOptions(**{**preset_options(name), **parse_variant(variant)})
    model = load_pretrained(ckpt, options=options)
    ts = make_train_step(model.config, AlgoConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH),
                         OptimConfig(lr=LR, weight_decay=0.0, grad_clip=1.0), options=options)
    state = ts.init_state(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    tokens, mask, rollout, adv = make_data(name)
    b, t = tokens.shape
    batch = Batch(tokens=tokens, positions=np.tile(np.arange(t, dtype=np.int32), (b, 1)),
                  segment_ids=np.ones((b, t), np.int32), loss_mask=mask, advantages=adv, rollout_logp=rollout,
                  old_logp=rollout, ref_logp=np.zeros_like(rollout), fresh=np.ones_like(rollout))
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        state, metrics = ts(state, batch)  # metrics are pulled to host: the step is complete
        jax.block_until_ready(state)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def worker_torch(name: str, ckpt: str, steps: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    tokens, mask, rollout, adv = (torch.tensor(x) for x in make_data(name))
    tokens = tokens.long()

    def step():
        logits = model(input_ids=tokens).logits.float()
        logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]
        logp = torch.nn.functional.pad(logp, (1, 0))
        ratio = torch.exp(torch.clamp(logp - rollout, -20, 20))
        per_tok = -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
        loss = (per_tok * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        step()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return times


def gemm_peak(n: int = 2048, reps: int = 10, dtype: str = "float32") -> float:
    """This machine's GEMM rate in JAX (GFLOP/s): an n x n x n matmul in ``dtype``, median of ``reps``."""
    import jax
    import jax.numpy as jnp

    a = jnp.asarray(np.random.RandomState(0).randn(n, n).astype(np.float32)).astype(dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        ts.append(time.perf_counter() - t0)
    return 2 * n ** 3 / statistics.median(ts) / 1e9


def worker_env(hugepages: bool) -> dict[str, str]:
    """The environment of a worker: with ``glibc.malloc.hugetlb=1`` (as our entry points run, see
    jaxrl_term/utils/hugepages.py; given to both sides alike) or without it (the environment rows)."""
    from jaxrl_term.utils import hugepages as hp

    env = {k: v for k, v in os.environ.items() if k != hp.OPT_OUT}
    if hugepages:
        return hp.tuned_env(env) if hp.wanted(env) else env
    tunables = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and not t.startswith(hp.TUNABLE)]
    return {**env, **({"GLIBC_TUNABLES": ":".join(tunables)} if tunables else {})}


def run_worker(side: str, name: str, ckpt: str, steps: int, variant: str = "", hugepages: bool = True
               ) -> tuple[list[float], float]:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", side, "--config", name, "--ckpt", ckpt, "--steps", str(steps)]
        + (["--variant", variant] if variant else []) + (["--peak"] if side == "peak" else []),
        capture_output=True, text=True, check=False, env=worker_env(hugepages),
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["times"], res["peak_rss_mb"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="tiny,100m,0.6b")
    ap.add_argument("--no-variants", dest="variants", action="store_false",
                    help="skip the rows of ours with one option changed (VARIANTS)")
    ap.add_argument("--variant", default="")
    ap.add_argument("--no-hugepages-row", dest="hugepages_row", action="store_false",
                    help="skip the 100m row with glibc's huge-page malloc off on both sides")
    ap.add_argument("--peak", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "train_step.md"))
    ap.add_argument("--worker", choices=["ours", "torch", "peak"])
    ap.add_argument("--config")
    ap.add_argument("--ckpt")
    args = ap.parse_args()
    if args.worker == "peak":  # in its own process, between the workers: the GEMM rate the steps are held to
        print(json.dumps({"times": [gemm_peak()], "peak_rss_mb": 0.0}))
        return
    if args.worker:
        times = (worker_ours(args.config, args.ckpt, args.steps, args.variant) if args.worker == "ours"
                 else worker_torch(args.config, args.ckpt, args.steps))
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"times": times, "peak_rss_mb": peak}))
        return

    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    header = ("| config | params | batch x len | ours tok/s | torch eager tok/s | ratio (ours/torch) | ours % of GEMM peak "
              "| torch % of GEMM peak | ours peak RSS MB | torch peak RSS MB |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(header)
    rows, peaks_gflops = [], []
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as d:
            torch.manual_seed(0)
            hf = Qwen3ForCausalLM(Qwen3Config(**CONFIGS[name], rope_theta=1e6))
            n_params = sum(p.numel() for p in hf.parameters())
            hf.save_pretrained(d)
            del hf
            sides = ["ours", "torch"] + ([f"ours:{v}" for v in VARIANTS[name]] if args.variants else [])
            if name == "100m" and args.hugepages_row:
                sides += ["ours@off", "torch@off"]
            times = {k: [] for k in sides}
            peaks = {k: 0.0 for k in sides}
            rounds, steps = ROUNDS[name] or args.rounds, max(args.steps, MIN_STEPS[name])
            for _ in range(rounds):
                peaks_gflops.append(run_worker("peak", name, d, 0)[0][0])
                for side in sides:
                    spec, _, env = side.partition("@")
                    kind, _, variant = spec.partition(":")
                    t, peak = run_worker(kind, name, d, steps, variant, hugepages=env != "off")
                    times[side] += t
                    peaks[side] = max(peaks[side], peak)
        b, t = BATCH[name]
        peak_gflops = statistics.median(peaks_gflops)
        flops = 6 * n_params * b * t  # 6 N T: forward + backward of the dense weights (attention not counted)
        pairs = [(name, "ours", "torch")] + [(f"{name} ({s.partition(':')[2]})", s, "torch")
                                             for s in sides if s.startswith("ours:")]
        if "ours@off" in sides:
            pairs.append((f"{name} ({NO_HUGEPAGES})", "ours@off", "torch@off"))
        for label, ours, peer in pairs:
            tps = {k: b * t / statistics.median(times[k]) for k in (ours, peer)}
            mfu = {k: 100 * flops / statistics.median(times[k]) / 1e9 / peak_gflops for k in (ours, peer)}
            row = (f"| {label} | {n_params / 1e6:.1f}M | {b} x {t} | {tps[ours]:,.0f} | {tps[peer]:,.0f} | "
                   f"{tps[ours] / tps[peer]:.2f} | {mfu[ours]:.0f}% | {mfu[peer]:.0f}% | {peaks[ours]:,.0f} | "
                   f"{peaks[peer]:,.0f} |")
            print(row, flush=True)
            rows.append(row)
    import jax

    from jaxrl_term.utils.hugepages import thp_mode

    env = (f"jax {jax.__version__} (cpu), torch {torch.__version__}, transformers {transformers.__version__}, "
           f"{platform.machine()}, {os.cpu_count()} CPU threads; fp32; median over {args.rounds} x {args.steps} "
           f"steps after 2 warm-up steps per worker ({args.rounds} x {max(args.steps, MIN_STEPS['tiny'])} at tiny, "
           "1 round at 0.6b); peak RSS is the whole worker process "
           f"(libraries included). GEMM peak: a 2048^3 fp32 matmul in JAX, measured before every round, median "
           f"{statistics.median(peaks_gflops):.0f} GFLOP/s; % of peak = 6 N T / step time / peak (attention and "
           "the optimizer not counted). Ours runs with the options of the model preset for its size "
           "(conf/model/tiny.yaml, bench_100m.yaml; ModelOptions' defaults at 0.6b); rows with an option in "
           "parentheses: ours with that one ModelOptions field changed (what it is worth). Both sides run with "
           "glibc's `glibc.malloc.hugetlb=1` (our entry points set it: jaxrl_term/utils/hugepages.py), except in "
           f"the row that turns it off on both sides (kernel THP mode: {thp_mode()}).")
    text = ("# RL update step: jaxrl_term (jax.jit) vs PyTorch eager (transformers Qwen3 + same loss + AdamW)\n\n"
            f"Tokens per second count every position of the batch. {env}\n\n"
            f"Reproduce: `.venv/bin/python experiments/bench/train_step.py`\n\n{header}\n" + "\n".join(rows) + "\n")
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
