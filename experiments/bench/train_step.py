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
}
BATCH = {"tiny": (8, 256), "100m": (4, 256)}
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


def worker_ours(name: str, ckpt: str, steps: int) -> list[float]:
    import jax
    from flax import nnx

    from jaxrl_term.model.hf import load_pretrained
    from jaxrl_term.rl.batch import Batch
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step

    model = load_pretrained(ckpt)
    ts = make_train_step(model.config, AlgoConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH),
                         OptimConfig(lr=LR, weight_decay=0.0, grad_clip=1.0))
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


def run_worker(side: str, name: str, ckpt: str, steps: int) -> tuple[list[float], float]:
    out = subprocess.run(
        [sys.executable, __file__, "--worker", side, "--config", name, "--ckpt", ckpt, "--steps", str(steps)],
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{side} worker failed:\n{out.stderr[-3000:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["times"], res["peak_rss_mb"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--configs", default="tiny,100m")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "train_step.md"))
    ap.add_argument("--worker", choices=["ours", "torch"])
    ap.add_argument("--config")
    ap.add_argument("--ckpt")
    args = ap.parse_args()
    if args.worker:
        times = (worker_ours if args.worker == "ours" else worker_torch)(args.config, args.ckpt, args.steps)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"times": times, "peak_rss_mb": peak}))
        return

    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    header = ("| config | params | batch x len | ours tok/s | torch eager tok/s | ratio (ours/torch) | "
              "ours peak RSS MB | torch peak RSS MB |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(header)
    rows = []
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as d:
            torch.manual_seed(0)
            hf = Qwen3ForCausalLM(Qwen3Config(**CONFIGS[name], rope_theta=1e6))
            n_params = sum(p.numel() for p in hf.parameters())
            hf.save_pretrained(d)
            del hf
            times = {"ours": [], "torch": []}
            peaks = {"ours": 0.0, "torch": 0.0}
            for _ in range(args.rounds):
                for side in ("ours", "torch"):
                    t, peak = run_worker(side, name, d, args.steps)
                    times[side] += t
                    peaks[side] = max(peaks[side], peak)
        b, t = BATCH[name]
        tps = {k: b * t / statistics.median(v) for k, v in times.items()}
        row = (f"| {name} | {n_params / 1e6:.1f}M | {b} x {t} | {tps['ours']:,.0f} | {tps['torch']:,.0f} | "
               f"{tps['ours'] / tps['torch']:.2f} | {peaks['ours']:,.0f} | {peaks['torch']:,.0f} |")
        print(row, flush=True)
        rows.append(row)
    import jax

    env = (f"jax {jax.__version__} (cpu), torch {torch.__version__}, transformers {transformers.__version__}, "
           f"{platform.machine()}, {os.cpu_count()} CPU threads; fp32; median over {args.rounds} x {args.steps} "
           "steps after 2 warm-up steps per worker; peak RSS is the whole worker process (libraries included).")
    text = ("# RL update step: jaxrl_term (jax.jit) vs PyTorch eager (transformers Qwen3 + same loss + AdamW)\n\n"
            f"Tokens per second count every position of the batch. {env}\n\n"
            f"Reproduce: `.venv/bin/python experiments/bench/train_step.py`\n\n{header}\n" + "\n".join(rows) + "\n")
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
