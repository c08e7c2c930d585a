"""Sampling throughput: the embedded JAX engine vs transformers ``generate`` (torch, CPU), same weights.

Per configuration and batch size B (1, 8, 32): B prompts of 64 tokens, 64 new tokens each, greedy, EOS
ignored so every sequence runs to the end. Reports generated tokens/s over the whole call and the
time-to-first-token (a 1-token generation). Ours: B concurrent ``generate`` calls (continuous batching,
``max_batch`` = 32). Peer: one batched ``model.generate`` (KV cache on). Medians of ``--repeats`` runs after a
warm-up; both sides alternate within each repeat. Every call gets fresh random prompts, so our engine's prefix
reuse (which a GRPO group's G episodes do benefit from) never skips a prefill here.

    .venv/bin/python experiments/bench/sampler.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
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
PROMPT, NEW = 64, 64
SETTLE = 0.5  # s of idle before each timed call: torch's OpenMP workers spin after a call and would slow the next


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--configs", default="tiny,100m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "sampler.md"))
    args = ap.parse_args()

    import jax
    import torch
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from jaxrl_term.model.hf import load_pretrained
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    torch.set_num_threads(os.cpu_count() or 1)
    header = ("| config | batch | ours tok/s | transformers tok/s | ratio (ours/HF) | ours TTFT ms | HF TTFT ms |\n"
              "| --- | --- | --- | --- | --- | --- | --- |")
    print(header)
    rows = []
    for name in args.configs.split(","):
        torch.manual_seed(0)
        hf = Qwen3ForCausalLM(Qwen3Config(**CONFIGS[name], rope_theta=1e6)).eval()
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            engine = JaxEngine(load_pretrained(d), config=JaxEngineConfig(max_batch=32, max_seq_len=256))
        for b in map(int, args.batches.split(",")):
            rng = np.random.RandomState(b)

            def fresh():
                return rng.randint(1, CONFIGS[name]["vocab_size"], (b, PROMPT))

            async def ours(n_new: int):
                sp = SamplingParams(temperature=0, max_new_tokens=n_new)
                return await asyncio.gather(*(engine.generate(p.tolist(), sp) for p in fresh()))

            def theirs(n_new: int):
                with torch.inference_mode():
                    return hf.generate(torch.tensor(fresh()), max_new_tokens=n_new, min_new_tokens=n_new,
                                       do_sample=False, pad_token_id=0)

            asyncio.run(ours(NEW))  # compile / warm up
            asyncio.run(ours(1))
            theirs(NEW)
            t = {"ours": [], "hf": [], "ours_ttft": [], "hf_ttft": []}
            for _ in range(args.repeats):
                time.sleep(SETTLE)
                t0 = time.perf_counter()
                gens = asyncio.run(ours(NEW))
                t["ours"].append(time.perf_counter() - t0)
                assert all(len(g.output_ids) == NEW for g in gens)
                time.sleep(SETTLE)
                t0 = time.perf_counter()
                out = theirs(NEW)
                t["hf"].append(time.perf_counter() - t0)
                assert out.shape[1] == PROMPT + NEW
                time.sleep(SETTLE)
                t0 = time.perf_counter()
                asyncio.run(ours(1))
                t["ours_ttft"].append(time.perf_counter() - t0)
                time.sleep(SETTLE)
                t0 = time.perf_counter()
                theirs(1)
                t["hf_ttft"].append(time.perf_counter() - t0)
            reuse = engine.stats["reused_tokens"] / max(1, engine.stats["prefill_tokens"])
            assert reuse < 0.01, f"{reuse:.1%} of prompt tokens reused: the prefill was not measured"
            med = {k: statistics.median(v) for k, v in t.items()}
            tps_o, tps_h = b * NEW / med["ours"], b * NEW / med["hf"]
            row = (f"| {name} | {b} | {tps_o:,.0f} | {tps_h:,.0f} | {tps_o / tps_h:.2f} | "
                   f"{med['ours_ttft'] * 1000:.0f} | {med['hf_ttft'] * 1000:.0f} |")
            print(row, flush=True)
            rows.append(row)
        engine.close()
    env = (f"jax {jax.__version__} (cpu), torch {torch.__version__}, transformers {transformers.__version__}, "
           f"{platform.machine()}, {os.cpu_count()} CPU threads; fp32; greedy; prompt {PROMPT}, {NEW} new tokens; "
           f"median of {args.repeats}. Engine: JaxEngineConfig defaults (decode_steps={JaxEngineConfig.decode_steps}, "
           f"unstack_layers={JaxEngineConfig.unstack_layers}, fuse_projections={JaxEngineConfig.fuse_projections}, "
           f"contiguous_head={JaxEngineConfig.contiguous_head}); fresh prompts every call; {SETTLE} s idle before each timed call.")
    text = ("# Sampling: embedded JAX engine (continuous batching, KV cache) vs transformers `generate`\n\n"
            f"{env} TTFT = a 1-token generation for the whole batch.\n\n"
            f"Reproduce: `.venv/bin/python experiments/bench/sampler.py`\n\n{header}\n" + "\n".join(rows) + "\n")
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
