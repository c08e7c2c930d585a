"""Top-k / top-p sampling on a CPU: our sampler (``sample_tokens``) against transformers' logits warpers + draw.

Per vocabulary (32k: the 100M bench model; 151,936: Qwen3) and batch size (8, 32): one sampling step from
[B, V] logits, at temperature 1 with no truncation, top_k = 20, top_p = 0.95 on peaked logits (an LLM's usual
case: the cut among the largest 64), top_p = 0.95 on flat logits (the cut further out) and both (Qwen3's
recommended top_k = 20, top_p = 0.95). The peer is what transformers' ``generate`` runs per step for the same
settings: ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper`` (which sorts the whole
vocabulary), softmax and ``torch.multinomial``; ours also returns the log-prob of each sampled token. Also
shown: our previous sampler (a full sort of the vocabulary whenever top-k or top-p is set), kept here as
``sort_sampler``. Medians of ``--repeats`` timed calls after a warm-up, both sides alternating.

    .venv/bin/python experiments/bench/sampler_truncation.py
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

VOCABS = (32000, 151936)
BATCHES = (8, 32)
CASES = {  # name: (logit scale, top_p, top_k)
    "no truncation": (10.0, 1.0, -1),
    "top_k 20": (10.0, 1.0, 20),
    "top_p 0.95, peaked": (10.0, 0.95, -1),
    "top_p 0.95, flat": (0.5, 0.95, -1),
    "top_k 20 + top_p 0.95": (10.0, 0.95, 20),
}


def sort_sampler():
    """The sampler before this bench: top-k / top-p from a full descending sort of every row."""
    import jax
    import jax.numpy as jnp

    from jaxrl_term.rollout.jax_engine import first_max, inverse_cdf

    @jax.jit
    def sample(logits, temps, top_ps, top_ks, seeds, counters):
        v = logits.shape[-1]
        greedy = temps <= 0
        z = logits / jnp.where(greedy, 1.0, temps)[:, None]

        def truncate(z):
            srt = -jnp.sort(-z, axis=-1)
            k = jnp.where(top_ks > 0, jnp.minimum(top_ks, v), v)
            thr_k = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)[:, 0]
            p = jax.nn.softmax(srt, axis=-1)
            n_p = jnp.maximum(jnp.sum((jnp.cumsum(p, axis=-1) - p) < top_ps[:, None], axis=-1), 1)
            thr_p = jnp.take_along_axis(srt, (n_p - 1)[:, None], axis=-1)[:, 0]
            return jnp.where(z >= jnp.maximum(thr_k, thr_p)[:, None], z, -jnp.inf)

        z_s = jax.lax.cond(jnp.any((top_ps < 1.0) | (top_ks > 0)), truncate, lambda z: z, z)
        keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.PRNGKey(s), c))(seeds, counters)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys)
        tok = inverse_cdf(jnp.exp(z_s - jnp.max(z_s, axis=-1, keepdims=True)), u)
        tok = jnp.where(greedy, first_max(logits), tok).astype(jnp.int32)
        return tok, jnp.take_along_axis(z, tok[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(z, axis=-1)

    return sample


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "results" / "sampler_truncation.md"))
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from transformers.generation.logits_process import (LogitsProcessorList, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    from jaxrl_term.rollout.jax_engine import sample_tokens

    torch.set_num_threads(os.cpu_count() or 1)
    old = sort_sampler()
    header = ("| vocab | batch | case | ours ms | transformers warpers ms | previous (full sort) ms "
              "| **transformers / ours** | previous / ours |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(header)
    rows = []
    for v in VOCABS:
        for b in BATCHES:
            for case, (scale, top_p, top_k) in CASES.items():
                logits = (np.random.RandomState(b).randn(b, v) * scale).astype(np.float32)
                jargs = (jnp.asarray(logits), jnp.ones(b, jnp.float32), jnp.full(b, top_p, jnp.float32),
                         jnp.full(b, top_k, jnp.int32), jnp.arange(b, dtype=jnp.uint32), jnp.zeros(b, jnp.uint32))
                warpers = LogitsProcessorList([TemperatureLogitsWarper(1.0)]
                                              + ([TopKLogitsWarper(top_k)] if top_k > 0 else [])
                                              + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else []))
                tlogits, ids = torch.from_numpy(logits), torch.zeros((b, 1), dtype=torch.long)

                def theirs():
                    with torch.inference_mode():
                        scores = warpers(ids, tlogits.clone())
                        return torch.multinomial(torch.softmax(scores, dim=-1), 1)

                fns = {"ours": lambda: jax.block_until_ready(sample_tokens(*jargs)),
                       "hf": theirs, "old": lambda: jax.block_until_ready(old(*jargs))}
                for fn in fns.values():
                    fn()
                t = {k: [] for k in fns}
                for _ in range(args.repeats):
                    for k, fn in fns.items():
                        t0 = time.perf_counter()
                        fn()
                        t[k].append(time.perf_counter() - t0)
                ms = {k: statistics.median(x) * 1e3 for k, x in t.items()}
                row = (f"| {v:,} | {b} | {case} | {ms['ours']:.2f} | {ms['hf']:.2f} | {ms['old']:.2f} | "
                       f"**{ms['hf'] / ms['ours']:.2f}** | {ms['old'] / ms['ours']:.2f} |")
                print(row, flush=True)
                rows.append(row)
    env = (f"jax {jax.__version__} (cpu), torch {torch.__version__}, transformers {transformers.__version__}, "
           f"{platform.machine()}, {os.cpu_count()} CPU threads; median of {args.repeats} calls per cell.")
    text = ("# One sampling step with top-k / top-p on a CPU: ours vs transformers' logits warpers\n\n"
            f"{env} Ours: `jaxrl_term.rollout.jax_engine.sample_tokens` (top-k / top-p from the largest 64 logits "
            "when the cut falls among them, else a bisection; also returns the sampled tokens' log-probs). "
            "transformers: Temperature/TopK/TopP warpers + softmax + multinomial, what `generate` does per step. "
            "Previous: our sampler before (`sort_sampler` here, as it was in `jax_engine.py`: a full sort of the "
            "vocabulary whenever top-k or top-p is set, and the exp, max and log-sum-exp passes done apart). "
            "Peaked logits: N(0, 10^2) (top-1 probability about 0.7, as an LLM at temperature 1 often is: the "
            "top-p cut among the largest 64); flat: N(0, 0.5^2) (the cut further out: the bisection).\n\n"
            f"Reproduce: `.venv/bin/python experiments/bench/sampler_truncation.py`\n\n{header}\n"
            + "\n".join(rows) + "\n")
    Path(args.out).write_text(text)
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
