"""Rollout engines: the embedded JAX engine (against transformers and our trainer's log-probs), the SGLang
client (against a real jaxrl_term.serve process and against SGLang-format response fixtures), faults."""

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from helpers import hf_checkpoint
from jaxrl_term.model.hf import load_pretrained, save_pretrained
from jaxrl_term.model.qwen3 import ModelOptions, lm_logits
from jaxrl_term.rl.logprobs import sequence_logprobs
from jaxrl_term.rollout.engine import EngineError, SamplingParams
from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig
from jaxrl_term.rollout.sglang import SGLangEngine, SGLangLauncher, ServerSpec, parse_generation, request_body

FIX = Path(__file__).parent / "fixtures" / "sglang"
VOCAB = 1024  # the tiny tokenizer's size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tiny_tokenizer_dir):
    d = tmp_path_factory.mktemp("tiny_model")
    hf = hf_checkpoint(d, rope_theta=10_000.0, vocab_size=VOCAB)
    for f in tiny_tokenizer_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d, hf


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = JaxEngine(load_pretrained(model_dir[0]), config=JaxEngineConfig(max_batch=16, max_seq_len=512))
    yield eng
    eng.close()


def prompts(n, seed=0, lo=3, hi=40):
    rng = np.random.RandomState(seed)
    return [rng.randint(0, VOCAB, rng.randint(lo, hi)).tolist() for _ in range(n)]


def run(coro):
    return asyncio.run(coro)


# ----------------------------------------------------------------------------------------- embedded engine


def test_greedy_decoding_equals_transformers_generate(model_dir, engine):
    _, hf = model_dir
    for p in prompts(3, seed=1):
        g = run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=24)))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                              eos_token_id=None)[0, len(p):].tolist()
        assert g.output_ids == ref and g.finish_reason == "length"


def test_sampled_log_probs_equal_the_trainers_recomputation(model_dir, engine):
    model = load_pretrained(model_dir[0])

    async def go():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(temperature=1.0, max_new_tokens=32, seed=i))
                                      for i, p in enumerate(prompts(6, seed=2))))

    gens = run(go())
    seqs = [p + g.output_ids for p, g in zip(prompts(6, seed=2), gens)]
    width = max(map(len, seqs))
    ids = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), np.int32)
    for k, s in enumerate(seqs):  # right-padded: one compiled program for all six
        ids[k, : len(s)], mask[k, : len(s)] = s, 1
    logp, _ = sequence_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), temperature=1.0)
    for k, (p, g) in enumerate(zip(prompts(6, seed=2), gens)):
        trainer = np.asarray(logp[k, len(p): len(seqs[k])])
        assert np.abs(trainer - np.asarray(g.output_logprobs)).max() <= 1e-4
        assert all(np.isfinite(g.output_logprobs)) and g.output_logprobs != [0.0] * len(g.output_logprobs)


def test_bf16_products_keep_fp32_log_probs_within_bf16_rounding_of_the_trainer(model_dir):
    """``matmul_dtype=bfloat16`` (with ``lm_head_fp32=false``, so the LM head too): the product weights are stored
    in bf16 (norms and embeddings stay fp32), the engine's log-probs stay within bf16 rounding of the trainer's
    fp32 recomputation (and are not the fp32 engine's numbers: the bf16 path is in effect), sampling is still
    per-request seeded, and a weight update keeps the products in bf16. ``lm_head_fp32`` wins over it for the
    head, as SGLang's --enable-fp32-lm-head does over bf16 weights."""
    model = load_pretrained(model_dir[0])
    eng = JaxEngine(load_pretrained(model_dir[0], options=ModelOptions(lm_head_fp32=False)),
                    config=JaxEngineConfig(max_batch=8, max_seq_len=512, matmul_dtype="bfloat16"))
    ps = prompts(6, seed=2)

    async def go(e):
        return await asyncio.gather(*(e.generate(p, SamplingParams(temperature=1.0, max_new_tokens=32, seed=i))
                                      for i, p in enumerate(ps)))

    def weight_dtypes():
        layer = eng.w["layers"][0]
        return ({str(layer[k + "_nk"].dtype) for k in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")},
                str(eng.w["head_nk"].dtype), str(layer["input_layernorm"].dtype), str(eng.w["embed"].dtype))

    try:
        assert weight_dtypes() == ({"bfloat16"}, "bfloat16", "float32", "float32")
        gens = run(go(eng))
        assert [g.output_ids for g in run(go(eng))] == [g.output_ids for g in gens]  # seeded: reproducible
        seqs = [p + g.output_ids for p, g in zip(ps, gens)]
        ids = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
        mask = np.zeros_like(ids)
        for k, s in enumerate(seqs):
            ids[k, : len(s)], mask[k, : len(s)] = s, 1
        logp, _ = sequence_logprobs(model, jnp.asarray(ids), jnp.asarray(mask), temperature=1.0)
        gaps = np.concatenate([np.asarray(logp[k, len(p): len(seqs[k])]) - np.asarray(g.output_logprobs)
                               for k, (p, g) in enumerate(zip(ps, gens))])
        assert np.isfinite(gaps).all() and np.abs(gaps).max() <= 0.05, np.abs(gaps).max()
        assert np.abs(gaps).max() > 1e-4  # the fp32 engine is within 1e-4 (the test above): these are bf16 sums
        params = nnx.to_pure_dict(nnx.state(model))
        run(eng.update_weights(jax.tree.map(lambda x: x * 1.01, params), 3))
        assert weight_dtypes() == ({"bfloat16"}, "bfloat16", "float32", "float32")
        after = run(eng.generate(ps[0], SamplingParams(temperature=0, max_new_tokens=8)))
        assert after.weight_version == 3 and len(after.output_ids) == 8
    finally:
        eng.close()
    with pytest.raises(ValueError, match="matmul_dtype"):
        JaxEngineConfig(matmul_dtype="fp8")
    h, w = jax.random.normal(jax.random.PRNGKey(0), (2, 3, 64)), jax.random.normal(jax.random.PRNGKey(1), (64, 99))
    np.testing.assert_array_equal(lm_logits(h, w, True, "bfloat16"), lm_logits(h, w, True))
    assert np.abs(np.asarray(lm_logits(h, w, False, "bfloat16") - lm_logits(h, w, True))).max() > 1e-4


def test_out_major_weights_give_the_same_generations_tied_and_untied(model_dir, tmp_path):
    """``out_major_weights`` (the default: product weights and LM head stored [out, in], multiplied from the left)
    against the [in, out] layout, on the untied fixture and on a tied checkpoint (whose LM head is then the
    embedding itself): the same greedy tokens as each other and as transformers, log-probs within fp32 rounding
    (fp32) and bf16 rounding (bf16 products, bf16 head), and the tied head is not a copy."""
    tied_dir = tmp_path / "tied"
    hf_tied = hf_checkpoint(tied_dir, tied=True, rope_theta=10_000.0, vocab_size=VOCAB, seed=3)
    ps = prompts(4, seed=9)

    async def go(e):
        return await asyncio.gather(*(e.generate(p, SamplingParams(temperature=0, max_new_tokens=20)) for p in ps))

    for d, hf in ((model_dir[0], model_dir[1]), (tied_dir, hf_tied)):
        with torch.no_grad():
            ref = [hf.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, pad_token_id=0,
                               eos_token_id=None)[0, len(p):].tolist() for p in ps]
        for mm, tol in ((None, 1e-5), ("bfloat16", 3e-2)):
            gens = {}
            for out_major in (True, False):
                eng = JaxEngine(load_pretrained(d, options=ModelOptions(lm_head_fp32=mm is None)),
                                config=JaxEngineConfig(max_batch=4, max_seq_len=128, matmul_dtype=mm,
                                                       out_major_weights=out_major))
                try:
                    assert (eng.w["head_nk"] is not None) == out_major and (eng.w["head"] is None) == out_major
                    if out_major and d == tied_dir and mm is None:
                        assert eng.w["head_nk"] is eng.w["embed"]  # the embedding itself, no [V, H] copy
                    gens[out_major] = run(go(eng))
                finally:
                    eng.close()
            new, old = gens[True], gens[False]
            assert [g.output_ids for g in new] == [g.output_ids for g in old]
            if mm is None:
                assert [g.output_ids for g in new] == ref, d
            for a, b in zip(new, old):
                assert np.abs(np.asarray(a.output_logprobs) - np.asarray(b.output_logprobs)).max() <= tol
    with pytest.raises(ValueError, match="out_major_weights"):
        JaxEngineConfig(fuse_projections=False)


def test_continuous_batching_of_32_requests_is_correct_and_faster(engine):
    ps = prompts(32, seed=3, lo=2, hi=60)
    sps = [SamplingParams(temperature=0, max_new_tokens=8 + (i % 5) * 6) for i in range(32)]

    async def sequential():
        return [await engine.generate(p, s) for p, s in zip(ps, sps)]

    async def concurrent():
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(ps, sps)))

    run(sequential())  # compile every shape bucket (batch sizes, lengths) once
    run(concurrent())
    t0 = time.monotonic()
    seq = run(sequential())
    t_seq = time.monotonic() - t0
    t0 = time.monotonic()
    con = run(concurrent())
    t_con = time.monotonic() - t0
    for a, b, s in zip(seq, con, sps):
        assert a.output_ids == b.output_ids and len(b.output_ids) == s.max_new_tokens
    assert t_con < 0.8 * t_seq, (t_con, t_seq)  # measured ~0.3 on 2 cores; margin for a loaded machine


def test_prefix_reuse_gives_the_same_tokens(model_dir, engine):
    p = prompts(1, seed=4)[0]
    first = run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=10)))
    follow = p + first.output_ids + prompts(1, seed=5, lo=5, hi=6)[0]
    again = run(engine.generate(follow, SamplingParams(temperature=0, max_new_tokens=10)))
    assert again.cached_tokens >= len(p)
    cold = JaxEngine(load_pretrained(model_dir[0]), config=JaxEngineConfig(max_batch=2, max_seq_len=512,
                                                                            prefix_reuse=False))
    try:
        ref = run(cold.generate(follow, SamplingParams(temperature=0, max_new_tokens=10)))
    finally:
        cold.close()
    assert again.output_ids == ref.output_ids and ref.cached_tokens == 0


def test_kv_cache_follows_the_attended_window_and_keeps_reusable_prefixes(model_dir):
    """The per-layer caches are as long as the attended window (so a full-width decode attends the cache buffers
    themselves), grow for a long prompt, never shrink under a prefix a free slot keeps for reuse, and shrink once
    it is gone. Every output equals a reference engine's (batch 1 of 8 slots: the row-gather path)."""
    cfg = dict(max_seq_len=1024, min_bucket=64)
    eng = JaxEngine(load_pretrained(model_dir[0]), config=JaxEngineConfig(max_batch=4, **cfg))
    ref = JaxEngine(load_pretrained(model_dir[0]), config=JaxEngineConfig(max_batch=8, prefix_reuse=False, **cfg))
    sp = SamplingParams(temperature=0, max_new_tokens=24)

    def length():
        return eng.kc[0].shape[-1]

    async def together(e, ps):
        return await asyncio.gather(*(e.generate(p, sp) for p in ps))

    try:
        assert isinstance(eng.kc, list) and length() == 64
        long_p = prompts(1, seed=30, lo=300, hi=301)[0]
        first = run(eng.generate(long_p, sp))
        assert length() == 512 and first.output_ids == run(ref.generate(long_p, sp)).output_ids
        shorts = prompts(3, seed=31, lo=5, hi=20)  # 3 rows + the long prefix's free slot: a full-width batch
        out = run(together(eng, shorts))
        assert length() == 512  # the free slot's 323 cached tokens are kept
        assert [g.output_ids for g in out] == [run(ref.generate(p, sp)).output_ids for p in shorts]
        follow = long_p + first.output_ids + [5, 6, 7]
        again = run(eng.generate(follow, sp))
        assert again.cached_tokens >= len(long_p) and again.output_ids == run(ref.generate(follow, sp)).output_ids
        resizes = eng.stats["cache_resizes"]
        fresh = prompts(4, seed=32, lo=5, hi=20)  # every slot taken: the long prefix is evicted
        out = run(together(eng, fresh))
        assert length() == 64 and eng.stats["cache_resizes"] > resizes
        assert [g.output_ids for g in out] == [run(ref.generate(p, sp)).output_ids for p in fresh]
    finally:
        eng.close()
        ref.close()


def test_seeded_sampling_does_not_depend_on_batching_and_params_behave(engine):
    p = prompts(1, seed=6)[0]
    sp = SamplingParams(temperature=0.9, top_p=0.8, max_new_tokens=12, seed=1234)
    alone = run(engine.generate(p, sp))

    async def crowd():
        others = [engine.generate(q, SamplingParams(temperature=1.0, max_new_tokens=20)) for q in prompts(7, seed=7)]
        res = await asyncio.gather(engine.generate(p, sp), *others)
        return res[0]

    assert run(crowd()).output_ids == alone.output_ids
    greedy = run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=12)))
    top1 = run(engine.generate(p, SamplingParams(temperature=1.3, top_k=1, max_new_tokens=12, seed=9)))
    assert top1.output_ids == greedy.output_ids
    stop_at = greedy.output_ids[3]
    stopped = run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop_at,))))
    assert stopped.finish_reason == "stop" and stopped.output_ids == greedy.output_ids[: greedy.output_ids.index(stop_at) + 1]
    assert stopped.matched_stop == stop_at


def test_update_weights_from_live_params_and_a_bad_update_keeps_the_old(model_dir, engine):
    p = prompts(1, seed=8)[0]
    before = run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8)))
    model = load_pretrained(model_dir[0])
    params = nnx.to_pure_dict(nnx.state(model))
    params["lm_head"] = params["lm_head"] * -1.0
    run(engine.update_weights(params, 11))
    after = run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8)))
    assert after.weight_version == 11 and after.output_ids != before.output_ids
    with pytest.raises(EngineError, match="structure"):
        run(engine.update_weights({"embed_tokens": params["embed_tokens"]}, 12))
    with pytest.raises(EngineError, match="keeps serving"):
        run(engine.update_weights("/nonexistent/model/dir", 13))
    assert run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8))).weight_version == 11
    run(engine.update_weights(nnx.to_pure_dict(nnx.state(model)), 14))  # restore for the other tests
    assert run(engine.generate(p, SamplingParams(temperature=0, max_new_tokens=8))).output_ids == before.output_ids


def test_the_engines_first_weights_survive_the_trainer_donating_its_params(model_dir):
    """The trainer builds the engine from its live params, then its first update donates them while the next
    step's rollouts decode (max_off_policy_steps >= 1): the engine must hold its own copy from the start, not
    only after the first update_weights (the embedding and norms were aliased: every engine step failed with
    "Array has been deleted" until the first weight sync)."""
    model = load_pretrained(model_dir[0])
    eng = JaxEngine(model, config=JaxEngineConfig(max_batch=2, max_seq_len=256))
    try:
        p = prompts(1, seed=9)[0]
        before = run(eng.generate(p, SamplingParams(temperature=0, max_new_tokens=8)))
        params = nnx.to_pure_dict(nnx.state(model))
        jax.block_until_ready(jax.jit(lambda w: jax.tree.map(lambda x: x * 0, w), donate_argnums=0)(params))
        assert all(x.is_deleted() for x in jax.tree.leaves(params))  # donated, as the train step does
        after = run(eng.generate(p, SamplingParams(temperature=0, max_new_tokens=8)))
        assert after.output_ids == before.output_ids and after.weight_version == before.weight_version
    finally:
        eng.close()


# ------------------------------------------------------------------------------ SGLang client vs our server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def launcher(model_dir, tmp_path_factory):
    lau = SGLangLauncher(str(model_dir[0]), [ServerSpec(free_port())], python=sys.executable,
                         module="jaxrl_term.serve", extra_args=["--max-running-requests", "8", "--context-length", "512"],
                         log_dir=str(tmp_path_factory.mktemp("serve_logs")))
    lau.start()
    try:
        run(lau.wait_ready(180))
        yield lau
    finally:
        lau.stop()
        assert all(p.poll() is not None for p in lau.procs) or not lau.procs


def client(launcher, **kw) -> SGLangEngine:
    return SGLangEngine(launcher.urls, **kw)


def test_sglang_client_token_in_token_out_against_our_server(launcher, model_dir, tiny_tokenizer_dir):
    from jaxrl_term.model.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_tokenizer_dir)
    _, hf = model_dir
    p = tok("ls -la /app", add_special_tokens=False)["input_ids"]

    async def go():
        c = client(launcher)
        try:
            g = await c.generate(p, SamplingParams(temperature=0, max_new_tokens=16), session="ep-1")
            stop_id = g.output_ids[5]
            s = await c.generate(p, SamplingParams(temperature=0, max_new_tokens=16, stop_token_ids=(stop_id,)))
            batch = await c.generate_batch([p, p[:3]], SamplingParams(temperature=0, max_new_tokens=6))
            raw = (await c.client.post(launcher.urls[0] + "/generate", json={"input_ids": p, "sampling_params": {
                "max_new_tokens": 4, "temperature": 0}, "return_logprob": True})).json()
            chat = (await c.client.post(launcher.urls[0] + "/v1/chat/completions", json={
                "model": "judge", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})).json()
            assert chat["object"] == "chat.completion" and chat["usage"]["completion_tokens"] <= 5
            assert isinstance(chat["choices"][0]["message"]["content"], str)
            return g, s, batch, raw
        finally:
            await c.aclose()

    g, s, batch, raw = run(go())
    with torch.no_grad():
        ref = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[0, len(p):].tolist()
    assert g.output_ids == ref and len(g.output_logprobs) == 16 and g.weight_version == 0
    assert s.finish_reason == "stop" and s.output_ids == ref[: ref.index(ref[5]) + 1] and s.matched_stop == ref[5]
    assert batch[0].output_ids == ref[:6] and len(batch) == 2
    # the server speaks SGLang's shape
    assert set(raw) == {"text", "output_ids", "meta_info"} and raw["meta_info"]["finish_reason"] == {"type": "length",
                                                                                                  "length": 4}
    assert [x[1] for x in raw["meta_info"]["output_token_logprobs"]] == raw["output_ids"]


def test_weight_sync_pause_continue_and_a_failed_update(launcher, model_dir, tmp_path):
    d, _ = model_dir
    model = load_pretrained(d)
    params = nnx.state(model)
    params["lm_head"].set_value(params["lm_head"][...] * -1.0)
    nnx.update(model, params)
    save_pretrained(model, tmp_path / "v5", dtype="float32")
    p = prompts(1, seed=9)[0]

    async def go():
        c = client(launcher, max_retries=0)
        try:
            before = await c.generate(p, SamplingParams(temperature=0, max_new_tokens=8))
            await c.update_weights(tmp_path / "v5", 5)
            info = await c.model_info()
            after = await c.generate(p, SamplingParams(temperature=0, max_new_tokens=8))
            # pause in place: a request waits until continue
            await c.client.post(launcher.urls[0] + "/pause_generation", json={"mode": "in_place"})
            task = asyncio.create_task(c.generate(p, SamplingParams(temperature=0, max_new_tokens=8)))
            await asyncio.sleep(1.0)
            waited = not task.done()
            await c.client.post(launcher.urls[0] + "/continue_generation", json={})
            resumed = await asyncio.wait_for(task, 60)
            with pytest.raises(EngineError, match="failed on 1 server"):
                await c.update_weights(tmp_path / "missing", 6)
            info_after_fail = await c.model_info()
            still = await c.generate(p, SamplingParams(temperature=0, max_new_tokens=8))
            await c.update_weights(d, 7)  # back to the original weights
            return before, info, after, waited, resumed, info_after_fail, still
        finally:
            await c.aclose()

    before, info, after, waited, resumed, info_fail, still = run(go())
    assert info["weight_version"] == "5" and after.weight_version == 5 and after.output_ids != before.output_ids
    assert waited and resumed.output_ids == after.output_ids
    assert info_fail["weight_version"] == "5" and still.weight_version == 5 and still.output_ids == after.output_ids


def test_server_killed_mid_request_raises_a_retryable_error(model_dir, tmp_path):
    lau = SGLangLauncher(str(model_dir[0]), [ServerSpec(free_port())], python=sys.executable,
                         module="jaxrl_term.serve", extra_args=["--context-length", "2048"], log_dir=str(tmp_path))
    lau.start()
    try:
        run(lau.wait_ready(180))

        async def go():
            c = SGLangEngine(lau.urls, max_retries=1, backoff_s=0.1)
            try:
                req = asyncio.create_task(c.generate(prompts(1)[0], SamplingParams(temperature=1.0, max_new_tokens=2000)))
                await asyncio.sleep(0.5)
                os.killpg(lau.procs[0].pid, signal.SIGKILL)  # dies mid-request, no graceful shutdown
                t0 = time.monotonic()
                with pytest.raises(EngineError) as e:
                    await asyncio.wait_for(req, 30)
                return e.value, time.monotonic() - t0
            finally:
                await c.aclose()

        err, waited = run(go())
        assert err.retryable and waited < 15
    finally:
        lau.stop(timeout_s=5)


# ---------------------------------------------------------------------------- SGLang 0.5 response fixtures


def _fixture_client(name: str, seen: list) -> SGLangEngine:
    body = json.loads((FIX / name).read_text())

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=body)

    return SGLangEngine(["http://sglang:30000"], transport=httpx.MockTransport(handler), context_length=32768)


def test_client_parses_sglang_response_fixtures():
    seen: list = []

    async def go(name, batch=False):
        c = _fixture_client(name, seen)
        try:
            sp = SamplingParams(temperature=0.7, max_new_tokens=64, stop_token_ids=(151645,), stop=("```\n",), seed=3)
            return await (c.generate_batch([[1, 2], [3]], sp) if batch else c.generate([1, 2, 3], sp))
        finally:
            await c.aclose()

    g = run(go("stop_by_id.json"))
    assert g.output_ids == [4730, 481, 4260, 198, 151645] and g.output_logprobs[2] == -1.25
    assert g.finish_reason == "stop" and g.matched_stop == 151645 and g.weight_version == 3 and g.cached_tokens == 48
    g = run(go("stop_by_string.json"))
    assert g.finish_reason == "stop" and g.matched_stop == "```\n" and len(g.output_ids) == 14
    g = run(go("length.json"))
    assert g.finish_reason == "length" and g.output_logprobs == [-1.0, -2.0, -3.0, -4.0] and g.matched_stop is None
    with pytest.raises(EngineError, match="aborted") as e:
        run(go("abort.json"))
    assert e.value.retryable
    a, b = run(go("batched.json", batch=True))
    assert a.finish_reason == "stop" and b.finish_reason == "length"
    # every request carries what token-in/token-out needs
    req = seen[0]
    assert req["input_ids"] == [1, 2, 3] and req["return_logprob"] is True
    sp = req["sampling_params"]
    assert sp["max_new_tokens"] == 64 and sp["stop_token_ids"] == [151645] and sp["stop"] == ["```\n"]
    assert sp["sampling_seed"] == 3 and sp["temperature"] == 0.7
    assert seen[-1]["input_ids"] == [[1, 2], [3]]


def test_inconsistent_or_incomplete_responses_are_errors():
    good = json.loads((FIX / "length.json").read_text())
    bad = json.loads(json.dumps(good))
    bad["output_ids"] = [1, 2, 3, 4]
    with pytest.raises(EngineError, match="disagree"):
        parse_generation(bad)
    del good["meta_info"]["output_token_logprobs"]
    with pytest.raises(EngineError, match="output_token_logprobs"):
        parse_generation(good)
    body = request_body([5], SamplingParams(max_new_tokens=7))
    assert body["sampling_params"]["max_new_tokens"] == 7 and "sampling_seed" not in body["sampling_params"]


def test_5xx_is_retried_then_reported_and_4xx_is_not_retried():
    calls = {"n": 0}

    def flaky(request):
        calls["n"] += 1
        if calls["n"] < 3:
            return httpx.Response(503, text="busy")
        return httpx.Response(200, json=json.loads((FIX / "length.json").read_text()))

    async def go(handler, retries):
        c = SGLangEngine(["http://s:1"], transport=httpx.MockTransport(handler), max_retries=retries, backoff_s=0.01,
                         context_length=4096)
        try:
            return await c.generate([1], SamplingParams(max_new_tokens=4))
        finally:
            await c.aclose()

    assert run(go(flaky, 3)).finish_reason == "length" and calls["n"] == 3
    with pytest.raises(EngineError, match="HTTP 400") as e:
        run(go(lambda r: httpx.Response(400, json={"error": {"message": "bad"}}), 3))
    assert not e.value.retryable
    with pytest.raises(EngineError, match="after 2 attempts") as e:
        run(go(lambda r: httpx.Response(502, text="bad gateway"), 1))
    assert e.value.retryable


def test_sessions_stick_to_a_server_and_new_ones_spread():
    hits: list[str] = []

    async def handler(request):  # a request takes a moment, as a real one does
        hits.append(request.url.host)
        await asyncio.sleep(0.01)
        return httpx.Response(200, json=json.loads((FIX / "length.json").read_text()))

    async def go():
        c = SGLangEngine(["http://a:1", "http://b:1"], transport=httpx.MockTransport(handler), context_length=4096)
        try:
            for turn in range(3):
                await asyncio.gather(c.generate([1], SamplingParams(), session="x"),
                                     c.generate([1], SamplingParams(), session="y"))
        finally:
            await c.aclose()

    run(go())
    assert len(set(hits[0::2])) == 1 and len(set(hits[1::2])) == 1 and set(hits) == {"a", "b"}


# ----------------------------------------------------------------------------------------- the sampler


def _chi2_ok(counts, probs, z=3.29):
    """Pearson's chi-square of counts against probs (cells with expected >= 5), below the Wilson-Hilferty
    approximation of the p = 0.0005 critical value."""
    n = counts.sum()
    exp = probs * n
    keep = exp >= 5
    obs_k, exp_k = np.append(counts[keep], counts[~keep].sum()), np.append(exp[keep], exp[~keep].sum())
    obs_k, exp_k = obs_k[exp_k > 0], exp_k[exp_k > 0]
    stat, df = float(((obs_k - exp_k) ** 2 / exp_k).sum()), len(exp_k) - 1
    crit = df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3
    return stat, crit


def test_sampler_draws_follow_softmax_and_respect_truncation():
    """One uniform per row through a two-level inverse CDF: the draws follow softmax(logits / T), impossible
    tokens (−inf, or cut by top-k / top-p) are never drawn, the log-prob is the untruncated one, greedy is the
    first maximum. V = 1000 is not a multiple of the 256-wide blocks."""
    from jaxrl_term.rollout.jax_engine import first_max, inverse_cdf, sample_tokens

    rng = np.random.RandomState(0)
    v, n = 1000, 40_000
    logits = (rng.randn(v) * 2.0).astype(np.float32)
    logits[rng.choice(v, 100, replace=False)] = -np.inf  # never drawn
    rows = np.broadcast_to(logits, (n, v))
    seeds, counters = np.full(n, 7, np.int32), np.arange(n, dtype=np.int32)

    def draw(temp, top_p=1.0, top_k=0):
        tok, lp = sample_tokens(jnp.asarray(rows), jnp.full(n, temp, jnp.float32), jnp.full(n, top_p, jnp.float32),
                                jnp.full(n, top_k, jnp.int32), jnp.asarray(seeds), jnp.asarray(counters))
        return np.asarray(tok), np.asarray(lp)

    def softmax(z):
        e = np.exp(z - z[np.isfinite(z)].max())
        return e / e.sum()

    for temp in (1.0, 0.7):
        tok, lp = draw(temp)
        p = softmax(logits / temp)
        assert np.all(p[tok] > 0), "drew a token of probability 0"
        stat, crit = _chi2_ok(np.bincount(tok, minlength=v), p)
        assert stat < crit, (temp, stat, crit)
        np.testing.assert_allclose(lp, np.log(p[tok]), rtol=1e-4, atol=1e-4)

    tok, lp = draw(1.0, top_k=5)
    top5 = np.argsort(-logits)[:5]
    assert set(np.unique(tok)) <= set(top5.tolist())
    p5 = np.zeros(v)
    p5[top5] = softmax(logits)[top5]
    stat, crit = _chi2_ok(np.bincount(tok, minlength=v), p5 / p5.sum())
    assert stat < crit, (stat, crit)
    np.testing.assert_allclose(lp, np.log(softmax(logits)[tok]), rtol=1e-4, atol=1e-4)  # untruncated log-prob

    p = softmax(logits)
    order = np.argsort(-p)
    nucleus = order[: int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1]  # smallest set with mass >= 0.5
    tok, _ = draw(1.0, top_p=0.5)
    assert set(np.unique(tok)) <= set(nucleus.tolist())
    pn = np.zeros(v)
    pn[nucleus] = p[nucleus]
    stat, crit = _chi2_ok(np.bincount(tok, minlength=v), pn / pn.sum())
    assert stat < crit, (stat, crit)

    tok, _ = draw(0.0)
    assert np.all(tok == int(np.argmax(logits)))
    ties = jnp.asarray([[0.0, 3.0, 1.0, 3.0], [jnp.nan, 0.0, 0.0, 0.0]])
    assert np.asarray(first_max(ties))[0] == 1  # the first of equal maxima, as argmax

    # Rounding at the top of the CDF: u just below 1 lands on the last possible entry, never on a zero after it;
    # a row whose mass sits in one entry of one block always draws it.
    w = np.zeros((3, 700), np.float32)
    w[0, :300] = 1.0
    w[1, 512] = 1e-30
    w[2, [3, 600]] = [1e-3, 1.0]
    idx = np.asarray(inverse_cdf(jnp.asarray(w), jnp.asarray([np.float32(1 - 2**-24), 0.5, 1 - 2**-24])))
    assert idx.tolist() == [299, 512, 600]


def test_top_k_top_p_cut_matches_a_full_sort_on_both_paths():
    """The top-k / top-p cut without a full sort (``truncation_mask``): the top TOP_WINDOW logits when the cut
    falls among them, else a bisection on the logits' order. Both paths keep exactly what a sorted reference
    keeps (the largest k; the smallest set of the largest with mass >= top_p; ties at the cut kept), on peaked
    and flat rows, ties, -0.0 next to 0.0, -inf entries and a top_k beyond the window."""
    from jaxrl_term.rollout.jax_engine import TOP_WINDOW, truncation_mask

    rng = np.random.RandomState(3)
    v = 3000  # > TOP_WINDOW, not a multiple of anything the engine uses

    def row(kind):
        if kind == "peaked":
            return rng.randn(v) * 4.0
        if kind == "flat":
            return rng.randn(v) * 0.3
        if kind == "ties":  # many equal values, and -0.0 beside 0.0
            z = np.round(rng.randn(v) * 1.5)
            z[z == 0] = np.where(rng.rand(int((z == 0).sum())) < 0.5, -0.0, 0.0)
            return z
        z = rng.randn(v) * 2.0  # "masked": impossible entries
        z[rng.choice(v, 500, replace=False)] = -np.inf
        return z

    def reference(z, top_p, top_k):
        """Kept entries and the number of sorted positions the cut needs (what decides the path)."""
        srt = np.sort(z)[::-1]
        p = np.exp(srt - srt[0])
        p /= p.sum()
        thr, need = -np.inf, 0
        if 0 < top_k < v:
            thr, need = srt[top_k - 1], top_k
        if top_p < 1.0:
            n = int(np.searchsorted(np.cumsum(p), top_p)) + 1  # smallest count whose mass reaches top_p
            need = n if thr == -np.inf else min(need, n)
            thr = max(thr, srt[n - 1])
        return z >= thr, need

    def check(cases):
        z = np.stack([row(kind) for kind, _, _ in cases]).astype(np.float32)
        top_p = np.array([c[1] for c in cases], np.float32)
        top_k = np.array([c[2] for c in cases], np.int32)
        zj = jnp.asarray(z)
        top = jnp.max(zj, axis=-1, keepdims=True)
        e = jnp.exp(zj - top)
        lse = top[:, 0] + jnp.log(jnp.sum(e, axis=-1))
        got = np.asarray(truncation_mask(zj, e, lse, jnp.asarray(top_p), jnp.asarray(top_k),
                                         jnp.zeros(len(cases), bool)))
        needs = []
        for i, (kind, tp, tk) in enumerate(cases):
            want, need = reference(z[i], tp, tk)
            needs.append(need)
            assert np.array_equal(got[i], want), (kind, tp, tk, int(got[i].sum()), int(want.sum()))
        return needs

    # every cut among the top TOP_WINDOW: the window decides all rows of the call
    near = [("peaked", 0.9, -1), ("peaked", 0.5, 20), ("flat", 1.0, 20), ("ties", 1.0, 5), ("masked", 0.3, -1),
            ("peaked", 1.0, -1), ("flat", 0.999, 1)]
    assert max(check(near)) <= TOP_WINDOW
    # some cuts further out: the bisection decides every row of the call, the near ones included
    far = near + [("flat", 0.9, -1), ("flat", 1.0, 200), ("ties", 0.95, -1), ("masked", 0.99, 300),
                  ("flat", 0.5, 100)]
    assert max(check(far)) > TOP_WINDOW


def test_multi_step_decode_equals_single_steps_and_stops_inside_a_call(model_dir, engine):
    """decode_steps = 16 (one program call per 16 tokens) against decode_steps = 1: the same tokens and
    log-probs, sampled and greedy; a stop token met inside a call ends the output there, and the tokens the
    row computed after it are dropped (max_new_tokens = 40: the 16-step path is taken)."""
    single = JaxEngine(load_pretrained(model_dir[0]), config=JaxEngineConfig(max_batch=16, max_seq_len=512,
                                                                              decode_steps=1))
    try:
        ps = prompts(4, seed=21)
        sps = [SamplingParams(temperature=1.0, max_new_tokens=40, seed=100 + i) for i in range(3)]
        sps.append(SamplingParams(temperature=0, max_new_tokens=40))

        async def both(eng):
            return await asyncio.gather(*(eng.generate(p, sp) for p, sp in zip(ps, sps)))

        multi, one = run(both(engine)), run(both(single))
        for a, b in zip(multi, one):
            assert a.output_ids == b.output_ids and len(a.output_ids) == 40
            np.testing.assert_allclose(a.output_logprobs, b.output_logprobs, atol=1e-5)
        greedy = multi[3].output_ids
        stop_at = next(t for i, t in enumerate(greedy) if i >= 5 and t not in greedy[:i])  # first seen mid-call
        stopped = run(engine.generate(ps[3], SamplingParams(temperature=0, max_new_tokens=40,
                                                            stop_token_ids=(stop_at,))))
        assert stopped.finish_reason == "stop" and stopped.output_ids == greedy[: greedy.index(stop_at) + 1]
    finally:
        single.close()


def test_launched_servers_die_with_the_trainer():
    """A server started through the launcher's hop gets SIGKILL when the process that started it dies (here by
    SIGKILL, so nothing of its own cleanup runs), and the hop runs the command itself (same pid, its output)."""
    import subprocess

    code = """
import os, subprocess, sys
from jaxrl_term.rollout.launcher import die_with_parent
echo = subprocess.run([*die_with_parent(), "echo", "hop ok"], capture_output=True, text=True)
p = subprocess.Popen([*die_with_parent(), "sleep", "120"], start_new_session=True)
print(echo.stdout.strip(), "|", p.pid, flush=True)
os.kill(os.getpid(), 9)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr[-2000:]
    said, pid = out.stdout.split("|")
    assert said.strip() == "hop ok"
    pid = int(pid)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the server {pid} outlived its trainer")
