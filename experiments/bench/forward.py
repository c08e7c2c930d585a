"""Forward throughput: our jitted flax.nnx Qwen3 vs transformers' Qwen3ForCausalLM (torch, CPU), same weights.

Each configuration: one random HF checkpoint written by transformers, loaded by both; warm-up, then
``--repeats`` timed forward passes each; the median tokens/s of each side and their ratio (ours / HF).
Both run fp32 on the same CPU threads. Prints a markdown table and writes it to experiments/results/.

    .venv/bin/python experiments/bench/forward.py [--repeats 7] [--out experiments/results/forward.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
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
POINTS = {"tiny": [(1, 128), (8, 128), (8, 512)], "100m": [(1, 128), (4, 128), (2, 512)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--configs", default="tiny,100m")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "forward.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from jaxrl_term.model.hf import load_pretrained

    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    rows = []
    header = (
        "| config | params | batch x len | ours tok/s | transformers tok/s | ratio (ours/HF) |\n"
        "| --- | --- | --- | --- | --- | --- |"
    )
    print(header)
    for name in args.configs.split(","):
        torch.manual_seed(0)
        hf = Qwen3ForCausalLM(Qwen3Config(**CONFIGS[name], rope_theta=1e6)).eval()
        n_params = sum(p.numel() for p in hf.parameters())
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            ours = load_pretrained(d)
        fwd = jax.jit(lambda m, x: m(x))
        for b, t in POINTS[name]:
            ids = np.random.RandomState(0).randint(0, CONFIGS[name]["vocab_size"], (b, t)).astype(np.int32)
            x_j, x_t = jnp.asarray(ids), torch.tensor(ids, dtype=torch.long)

            def run_ours():
                fwd(ours, x_j).block_until_ready()

            def run_hf():
                with torch.inference_mode():
                    hf(input_ids=x_t).logits

            times = {"ours": [], "hf": []}
            for fn in (run_ours, run_hf):
                fn()  # compile / warm up
                fn()
            for _ in range(args.repeats):  # interleaved, so machine noise hits both sides alike
                for key, fn in (("ours", run_ours), ("hf", run_hf)):
                    t0 = time.perf_counter()
                    fn()
                    times[key].append(time.perf_counter() - t0)
            ours_tps = b * t / statistics.median(times["ours"])
            hf_tps = b * t / statistics.median(times["hf"])
            row = (f"| {name} | {n_params / 1e6:.1f}M | {b} x {t} | {ours_tps:,.0f} | {hf_tps:,.0f} | "
                   f"{ours_tps / hf_tps:.2f} |")
            print(row, flush=True)
            rows.append(row)

    env = (
        f"jax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__}, transformers "
        f"{transformers.__version__}, {platform.processor() or platform.machine()}, {threads} CPU threads, "
        f"Python {sys.version.split()[0]}; median of {args.repeats} interleaved runs after 2 warm-ups; fp32."
    )
    text = (
        "# Forward throughput: jaxrl_term Qwen3 (jax.jit) vs transformers Qwen3ForCausalLM (torch)\n\n"
        f"Same random weights, same token ids, logits for every position. {env}\n\n"
        f"Reproduce: `.venv/bin/python experiments/bench/forward.py`\n\n{header}\n" + "\n".join(rows) + "\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
