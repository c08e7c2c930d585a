"""Sampling throughput: the embedded JAX engine vs transformers ``generate`` (torch, CPU), same weights.

Per configuration and batch size B (1, 8, 32): B prompts of 64 tokens, 64 new tokens each, greedy, EOS
ignored so every sequence runs to the end. Reports generated tokens/s over the whole call and the
time-to-first-token (a 1-token generation). Ours: B concurrent ``generate`` calls (continuous batching,
``max_batch`` = 32). Peer: one batched ``model.generate`` (KV cache on). Medians of ``--repeats`` runs after a
warm-up; both sides alternate within each repeat. Every call gets fresh random prompts, so our engine's prefix
reuse (which a GRPO group's G episodes do benefit from) never skips a prefill here.

Two precisions on each side, the same weights:
- fp32: ours with the model's fp32 products; transformers in fp32.
- bf16: ours with ``matmul_dtype=bfloat16`` and ``lm_head_fp32=False`` (bf16 weights and product inputs, LM head
  included, fp32 sums; norms, attention and log-probs fp32: the SGLang way); transformers with the whole model
  in bf16 (``model.to(torch.bfloat16)``: activations and norms in bf16 too, so it does less fp32 work than ours).
The headline ratio is ours bf16 over transformers fp32 (the issue's peer), next to the same-precision ratios.

The GEMM bound: the same generation as nothing but its matrix products (every layer's projections and the LM
head, XLA's GEMM on this machine: the prefill's at M = B x 64, each decode step's at M = B) timed in the same
run, in fp32 and in bf16 x bf16 -> fp32. No engine that does these products with this GEMM can beat it; "bound /
HF" is the largest ratio over transformers fp32 that the machine allows, whatever the engine does around them.
The bound's weights are laid out as the engine's (``out_major_weights``: [out, in], multiplied from the left),
the faster of the two layouts on this GEMM.

    .venv/bin/python experiments/bench/sampler.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import functools
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


def gemm_bound(cfg: dict, b: int, repeats: int, dtype: str = "float32") -> float:
    """Seconds for the matrix products alone of one call: prefill (B x PROMPT tokens through every layer, the
    head for the last token of each row) plus NEW - 1 decode steps at M = B (layers and head). Same shapes and
    dtype (fp32) as the engine's fused weights; each product's input depends on the previous output, so nothing
    is hoisted or skipped. ``dtype`` bfloat16: bf16 weights and inputs, fp32 sums (the engine's matmul_dtype)."""
    import jax
    import jax.numpy as jnp

    h, i, v, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    qd, kvd = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    key = iter(jax.random.split(jax.random.PRNGKey(0), 4 * n + 1))
    # stored [out, in] and multiplied from the left, as the engine's out_major_weights (about 2x the [in, out]
    # layout's speed at M = 8-32 on XLA's CPU GEMM, the same at a prefill's M)
    layers = [[(jax.random.normal(next(key), s, jnp.float32) * 0.02).astype(dtype)
               for s in ((qd + 2 * kvd, h), (h, qd), (2 * i, h), (h, i))] for _ in range(n)]
    head = (jax.random.normal(next(key), (v, h), jnp.float32) * 0.02).astype(dtype)

    def mm(x, w):
        return jnp.einsum("nk,mk->nm", w, x.astype(w.dtype), preferred_element_type=jnp.float32).T

    def body(x):
        for wqkv, wo, wgu, wd in layers:
            x = x + mm(mm(x, wqkv)[:, :qd], wo)
            x = x + mm(mm(x, wgu)[:, :i], wd)
        return x

    @jax.jit
    def prefill(x):
        x = body(x)
        return mm(x[:b], head)

    @jax.jit
    def decode(x):
        def step(x, _):
            logits = mm(body(x), head)
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
    from jaxrl_term.model.qwen3 import ModelOptions
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    torch.set_num_threads(os.cpu_count() or 1)
    header = ("| config | batch | ours bf16 tok/s | ours fp32 tok/s | HF fp32 tok/s | HF bf16 tok/s "
              "| **ours bf16 / HF fp32** | ours fp32 / HF fp32 | ours bf16 / HF bf16 | ours bf16 TTFT ms "
              "| HF fp32 TTFT ms | GEMM-bound fp32 / bf16 tok/s | ours fp32 / bound | ours bf16 / bound "
              "| bf16 bound / HF fp32 |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print(header)
    rows = []
    for name in args.configs.split(","):
        torch.manual_seed(0)
        hf = Qwen3ForCausalLM(Qwen3Config(**CONFIGS[name], rope_theta=1e6)).eval()
        with tempfile.TemporaryDirectory() as d:
            hf.save_pretrained(d)
            mm_engine = {"float32": None, "bfloat16": "bfloat16"}  # None: the model's own fp32 products
            # bf16: the LM head too (model.options.lm_head_fp32=false), as transformers in bf16
            engines = {mm: JaxEngine(load_pretrained(d, options=ModelOptions(lm_head_fp32=mm == "float32")),
                                     config=JaxEngineConfig(max_batch=32, max_seq_len=256, matmul_dtype=mm_engine[mm]))
                       for mm in ("float32", "bfloat16")}
        hf_bf16 = copy.deepcopy(hf).to(torch.bfloat16)
        peers = {"float32": hf, "bfloat16": hf_bf16}
        for b in map(int, args.batches.split(",")):
            rng = np.random.RandomState(b)

            def fresh():
                return rng.randint(1, CONFIGS[name]["vocab_size"], (b, PROMPT))

            def ours(mm: str, n_new: int):
                async def run():
                    sp = SamplingParams(temperature=0, max_new_tokens=n_new)
                    return await asyncio.gather(*(engines[mm].generate(p.tolist(), sp) for p in fresh()))
                gens = asyncio.run(run())
                assert all(len(g.output_ids) == n_new for g in gens)

            def theirs(mm: str, n_new: int):
                with torch.inference_mode():
                    out = peers[mm].generate(torch.tensor(fresh()), max_new_tokens=n_new, min_new_tokens=n_new,
                                             do_sample=False, pad_token_id=0)
                assert out.shape[1] == PROMPT + n_new

            runs = {f"{side}_{short}": functools.partial(fn, mm)
                    for side, fn in (("ours", ours), ("hf", theirs))
                    for mm, short in (("float32", "fp32"), ("bfloat16", "bf16"))}
            for fn in runs.values():  # compile / warm up
                fn(NEW)
                fn(1)
            t = {k: [] for k in runs} | {k + "_ttft": [] for k in ("ours_bf16", "hf_fp32")}
            for _ in range(args.repeats):  # the four alternate within each repeat
                for k, fn in runs.items():
                    time.sleep(SETTLE)
                    t0 = time.perf_counter()
                    fn(NEW)
                    t[k].append(time.perf_counter() - t0)
                for k in ("ours_bf16", "hf_fp32"):
                    time.sleep(SETTLE)
                    t0 = time.perf_counter()
                    runs[k](1)
                    t[k + "_ttft"].append(time.perf_counter() - t0)
            for e in engines.values():
                reuse = e.stats["reused_tokens"] / max(1, e.stats["prefill_tokens"])
                assert reuse < 0.01, f"{reuse:.1%} of prompt tokens reused: the prefill was not measured"
            tps = {k: b * NEW / statistics.median(t[k]) for k in runs}
            ttft = {k: statistics.median(t[k + "_ttft"]) * 1000 for k in ("ours_bf16", "hf_fp32")}
            bound = {mm: b * NEW / gemm_bound(CONFIGS[name], b, args.repeats, mm) for mm in ("float32", "bfloat16")}
            row = (f"| {name} | {b} | {tps['ours_bf16']:,.0f} | {tps['ours_fp32']:,.0f} | {tps['hf_fp32']:,.0f} | "
                   f"{tps['hf_bf16']:,.0f} | **{tps['ours_bf16'] / tps['hf_fp32']:.2f}** | "
                   f"{tps['ours_fp32'] / tps['hf_fp32']:.2f} | {tps['ours_bf16'] / tps['hf_bf16']:.2f} | "
                   f"{ttft['ours_bf16']:.0f} | {ttft['hf_fp32']:.0f} | "
                   f"{bound['float32']:,.0f} / {bound['bfloat16']:,.0f} | {tps['ours_fp32'] / bound['float32']:.2f} | "
                   f"{tps['ours_bf16'] / bound['bfloat16']:.2f} | {bound['bfloat16'] / tps['hf_fp32']:.2f} |")
            print(row, flush=True)
            rows.append(row)
        for e in engines.values():
            e.close()
    env = (f"jax {jax.__version__} (cpu), torch {torch.__version__}, transformers {transformers.__version__}, "
           f"{platform.machine()}, {os.cpu_count()} CPU threads; greedy; prompt {PROMPT}, {NEW} new tokens; "
           f"median of {args.repeats}. Engine: JaxEngineConfig defaults (decode_steps={JaxEngineConfig.decode_steps}, "
           f"unstack_layers={JaxEngineConfig.unstack_layers}, fuse_projections={JaxEngineConfig.fuse_projections}, "
           f"out_major_weights={JaxEngineConfig.out_major_weights}); fresh prompts every call; {SETTLE} s idle before "
           "each timed call.")
    text = ("# Sampling: embedded JAX engine (continuous batching, KV cache) vs transformers `generate`\n\n"
            f"{env} ours bf16 = `rollout.jax.matmul_dtype=bfloat16 model.options.lm_head_fp32=false` (bf16 "
            "weights and product inputs, the LM head's included, fp32 sums; norms, attention and log-probs fp32); "
            "HF bf16 = the whole transformers model in bf16. The bold column "
            "is the headline (ours bf16 against the fp32 peer). TTFT = a 1-token generation for the whole batch. "
            "GEMM-bound: the same generation as nothing but its matrix products (every layer's projections and "
            "the LM head, XLA's GEMM, fp32 and bf16 x bf16 -> fp32, timed in this run): no engine built on that "
            "GEMM beats it, so `bound / HF` is the largest ratio the machine allows for the row and `ours / bound` "
            "how close the engine comes.\n\n"
            f"Reproduce: `.venv/bin/python experiments/bench/sampler.py`\n\n{header}\n" + "\n".join(rows) + "\n")
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
