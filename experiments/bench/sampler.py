"""Sampling throughput: the embedded JAX engine vs transformers ``generate`` (torch, CPU), same weights.

Per configuration and batch size B (1, 8, 32): B prompts of 64 tokens, 64 new tokens each, greedy, EOS
ignored so every sequence runs to the end. Reports generated tokens/s over the whole call and the
time-to-first-token (a 1-token generation). Ours: B concurrent ``generate`` calls (continuous batching,
``max_batch`` = 32). Peer: one batched ``model.generate`` (KV cache on). Medians of ``--repeats`` runs after a
warm-up; both sides alternate within each repeat. Every call gets fresh random prompts, so our engine's prefix
reuse (which a GRPO group's G episodes do benefit from) never skips a prefill here.

The GEMM bound: the same generation as nothing but its matrix products (every layer's projections and the LM
head, fp32, XLA's GEMM on this machine: the prefill's at M = B x 64, each decode step's at M = B) timed in the
same run. No fp32 engine that does these products with this GEMM can beat it; "bound / HF" is the largest
ratio over transformers that the machine allows for that row, whatever the engine does around the GEMMs.

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
GEMM_STEPS = 16  # decode steps per timed call of the GEMM-only program
SETTLE = 0.5  # s of idle before each timed call: torch's OpenMP workers spin after a call and would slow the next


def gemm_bound(cfg: dict, b: int, repeats: int) -> float:
    """Seconds for the matrix products alone of one call: prefill (B x PROMPT tokens through every layer, the
    head for the last token of each row) plus NEW - 1 decode steps at M = B (layers and head). Same shapes and
    dtype (fp32) as the engine's fused weights; each product's input depends on the previous output, so nothing
    is hoisted or skipped."""
    import jax
    import jax.numpy as jnp

    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    qd, kvd = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    key = iter(jax.random.split(jax.random.PRNGKey(0), 4 * n + 1))
    layers = [[jax.random.normal(next(key), s, jnp.float32) * 0.02
               for s in ((h, qd + 2 * kvd), (qd, h), (h, 2 * i), (i, h))] for _ in range(n)]
    head = jax.random.normal(next(key), (h, v), jnp.float32) * 0.02

    def body(x):
        for wqkv, wo, wgu, wd in layers:
            x = x + (x @ wqkv)[:, :qd] @ wo
            x = x + (x @ wgu)[:, :i] @ wd
        return x

    @jax.jit
    def prefill(x):
        x = body(x)
        return x[:b] @ head

    @jax.jit
    def decode(x):
        def step(x, _):
            logits = body(x) @ head
            return x + logits[:, :h] * 1e-6, None
        return jax.lax.scan(step, x, None, length=GEMM_STEPS)[0]

    xp, xd = jnp.ones((b * PROMPT, h), jnp.float32), jnp.ones((b, h), jnp.float32)
    prefill(xp).block_until_ready()
    decode(xd).block_until_ready()
    tp, td = [], []
    for _ in range(repeats):
        time.sleep(SETTLE)
        t0 = time.perf_counter()
        prefill(xp).block_until_ready()
        tp.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decode(xd).block_until_ready()
        td.append(time.perf_counter() - t0)
    return min(tp) + min(td) / GEMM_STEPS * (NEW - 1)


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
    header = ("| config | batch | ours tok/s | transformers tok/s | ratio (ours/HF) | ours TTFT ms | HF TTFT ms "
              "| GEMM-bound tok/s | ours / bound | bound / HF |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
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
            tps_b = b * NEW / gemm_bound(CONFIGS[name], b, args.repeats)
            row = (f"| {name} | {b} | {tps_o:,.0f} | {tps_h:,.0f} | {tps_o / tps_h:.2f} | "
                   f"{med['ours_ttft'] * 1000:.0f} | {med['hf_ttft'] * 1000:.0f} | {tps_b:,.0f} | "
                   f"{tps_o / tps_b:.2f} | {tps_b / tps_h:.2f} |")
            print(row, flush=True)
            rows.append(row)
        engine.close()
    env = (f"jax {jax.__version__} (cpu), torch {torch.__version__}, transformers {transformers.__version__}, "
           f"{platform.machine()}, {os.cpu_count()} CPU threads; fp32; greedy; prompt {PROMPT}, {NEW} new tokens; "
           f"median of {args.repeats}. Engine: JaxEngineConfig defaults (decode_steps={JaxEngineConfig.decode_steps}, "
           f"unstack_layers={JaxEngineConfig.unstack_layers}, fuse_projections={JaxEngineConfig.fuse_projections}, "
           f"contiguous_head={JaxEngineConfig.contiguous_head}); fresh prompts every call; {SETTLE} s idle before each timed call.")
    text = ("# Sampling: embedded JAX engine (continuous batching, KV cache) vs transformers `generate`\n\n"
            f"{env} TTFT = a 1-token generation for the whole batch. GEMM-bound: the same generation as nothing "
            "but its matrix products (every layer's projections and the LM head, fp32, XLA's GEMM, timed in this "
            "run): no fp32 engine built on that GEMM beats it, so `bound / HF` is the largest ratio the machine "
            "allows for the row and `ours / bound` how close the engine comes.\n\n"
            f"Reproduce: `.venv/bin/python experiments/bench/sampler.py`\n\n{header}\n" + "\n".join(rows) + "\n")
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
