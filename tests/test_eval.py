"""Evaluation: pass@k for any policy (``python -m jaxrl_term.eval``), resumable, and held-out evaluation during
training. The harness agents must score 1 (oracle) and 0 (nop) on sound tasks of every format; one checkpoint
through the embedded engine, through ``jaxrl_term.serve`` + the SGLang client, and loaded from orbax or HF
gives the same per-task results at temperature 0."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO, run_stacked
from jaxrl_term.agent.transcript import read_jsonl, to_markdown
from jaxrl_term.eval.core import failure_mode, pass_at_k, summarize

FIXTURES = REPO / "tests" / "fixtures" / "tasks"  # a Harbor task and a Terminal-Bench 1 task


ENV = {**os.environ, "XLA_FLAGS": ""}  # one CPU device in the processes these tests start


def _eval(args, timeout=600):
    return run_stacked([sys.executable, "-m", "jaxrl_term.eval", "eval.progress=false", *args], cwd=REPO,
                       timeout=timeout, env=ENV)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# ------------------------------------------------------------------------------------------------ pass@k


def test_pass_at_k_is_the_unbiased_estimator_on_a_hand_computed_example():
    # n = 5 attempts, c = 2 passed: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@3 = 1 - 1/10
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 2, 4) == 1.0  # fewer than k failures: every k-subset holds a pass
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 4, 1) == 1.0
    for n in range(1, 9):  # against the definition: the fraction of k-subsets with at least one pass
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_summary_pass_at_1_spread_pass_at_k_and_failure_modes_by_hand():
    def rec(task, j, ok, diff, fail=None):
        return {"task": task, "attempt": j, "pass": ok, "reward": float(ok), "difficulty": diff, "category": "c",
                "failure": fail, "turns": 2, "tokens": 100}

    # task a: 2 of 3 pass; task b: 0 of 3 (one agent timeout, two max turns); task c: 3 of 3
    records = [rec("a", 0, True, "easy"), rec("a", 1, False, "easy", "tests_failed"), rec("a", 2, True, "easy"),
               rec("b", 0, False, "hard", "agent_timeout"), rec("b", 1, False, "hard", "max_turns"),
               rec("b", 2, False, "hard", "max_turns"),
               rec("c", 0, True, "easy"), rec("c", 1, True, "easy"), rec("c", 2, True, "easy")]
    s = summarize(records, 3, invalid=[{"task": "b", "attempt": 3, "failure": "engine_error"}])
    assert s["pass@1"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    per_index = [2 / 3, 1 / 3, 2 / 3]  # the pass rate of attempt 0, 1, 2 over the tasks
    assert s["pass@1_per_attempt"] == pytest.approx(per_index)
    mean = sum(per_index) / 3
    assert s["pass@1_std"] == pytest.approx(math.sqrt(sum((x - mean) ** 2 for x in per_index) / 2))
    assert s["pass@k"] == pytest.approx((1 + 0 + 1) / 3) and s["k"] == 3
    assert s["pass_at"]["2"] == pytest.approx((pass_at_k(3, 2, 2) + 0 + 1) / 3)
    assert s["by_difficulty"]["easy"]["pass@1"] == pytest.approx((2 / 3 + 1) / 2)
    assert s["by_difficulty"]["hard"]["pass@k"] == 0.0
    assert s["failure_modes"] == {"tests_failed": 1, "agent_timeout": 1, "max_turns": 2, "engine_error": 1}
    assert s["per_task"]["a"] == {"attempts": 3, "passes": 2, "pass@1": pytest.approx(2 / 3), "pass@k": 1.0,
                                  "reward_mean": pytest.approx(2 / 3), "difficulty": "easy", "category": "c"}
    assert s["attempts_invalid"] == 1
    assert failure_mode("timeout", "scored", False) == "agent_timeout"
    assert failure_mode("finished", "test_timeout", False) == "test_timeout"
    assert failure_mode("finished", "scored", True) is None


# ------------------------------------------------------------------------------------- harness agents


@pytest.mark.docker
@pytest.mark.parametrize("source", ["builtin", "folders"])
def test_oracle_scores_1_and_nop_scores_0_on_heldout_harbor_and_tb1_tasks(docker_client, tmp_path, source):
    data = ["data.difficulties=[easy,medium,hard]", "data.limit=6"] if source == "builtin" else \
        [f"data.source={FIXTURES}"]
    for policy, want in (("oracle", 1.0), ("nop", 0.0)):
        out = tmp_path / policy
        r = _eval([f"policy={policy}", *data, "eval.attempts=2", f"run_dir={out}", "eval.report=false",
                   "sandbox.backend=docker"])
        assert r.returncode == 0, r.stderr[-3000:]
        s = _summary(out)
        assert s["pass@1"] == want and s["pass@k"] == want, (policy, s["failure_modes"], s["per_task"])
        assert s["attempts"] == 2 * s["tasks"] and s["attempts_invalid"] == 0
        if source == "folders":
            formats = {json.loads(line)["task"] for line in (out / "attempts.jsonl").read_text().splitlines()}
            assert formats == {"harbor-json-keys", "tb1-word-count"}
        trs = read_jsonl(out / "transcripts.jsonl")
        assert len(trs) == s["attempts"] and all("token_ids" not in t for t in trs)
        if policy == "oracle":  # the solution script and its output are in the transcript
            assert all(t["turns"][0]["actions"][0]["tool"] == "bash" and t["pass"] and all(t["tests"].values())
                       for t in trs)
            # per-test results where the verifier has them (pytest); a Harbor reward file otherwise
            assert all(t["tests"] or t["verifier_rewards"] for t in trs)


def test_bad_eval_config_exits_2_naming_the_key_before_any_run_dir(tmp_path):
    other = tmp_path / "other_run"  # a training run of a wider model
    (other / "checkpoints" / "3").mkdir(parents=True)
    (other / "config.yaml").write_text("model:\n  name: wide\n  hidden_size: 128\n")
    cases = [(["policy=checkpoint", f"policy.path={other}"], "model: policy.path was trained with another model"),(["policy=bogus"], "In 'eval_config': Could not find 'policy/bogus'"),
             (["policy=openai", "policy.model=m"], "policy.base_url"),
             (["policy=checkpoint", f"policy.path={tmp_path / 'nowhere'}"], "policy.path"),
             (["policy=sglang"], "rollout.sglang.urls"),
             (["policy=nop", "eval.attempts=0"], "eval.attempts"),
             (["policy=nop", f"data.source={tmp_path / 'no_tasks'}"], "data.source")]
    for args, key in cases:
        out = tmp_path / "run"
        r = _eval([*args, f"run_dir={out}"], timeout=120)
        assert r.returncode == 2, (args, r.stderr[-2000:])
        assert f"config error: {key}" in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr
        assert not out.exists()


# ------------------------------------------------------------------------------------- resumability


@pytest.mark.docker
def test_a_killed_eval_restarted_reruns_no_finished_attempt(docker_client, tmp_path):
    out = tmp_path / "run"
    args = ["policy=oracle", "data.difficulties=[easy]", "data.limit=4", "eval.attempts=2", "eval.concurrency=1",
            f"run_dir={out}", "eval.report=false", "sandbox.backend=docker"]
    p = subprocess.Popen([sys.executable, "-m", "jaxrl_term.eval", "eval.progress=false", *args], cwd=REPO,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=ENV)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(read_jsonl(out / "attempts.jsonl")) < 3:
            time.sleep(0.2)
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    before = read_jsonl(out / "attempts.jsonl")
    assert 3 <= len(before) < 8, len(before)
    r = _eval(args)
    assert r.returncode == 0, r.stderr[-3000:]
    after = read_jsonl(out / "attempts.jsonl")
    keys = [(a["task"], a["attempt"]) for a in after]
    assert len(keys) == len(set(keys)) == 8
    by_key = {(a["task"], a["attempt"]): a for a in after}
    for b in before:  # finished attempts are kept as they were (same wall time: not run again)
        assert by_key[(b["task"], b["attempt"])] == b
    s = _summary(out)
    assert s["attempts_run"] == 8 - len(before) and s["pass@1"] == 1.0
    ids = [t["id"] for t in read_jsonl(out / "transcripts.jsonl")]
    assert sorted(ids) == sorted(a["id"] for a in after)  # one transcript per finished attempt, no orphan


# --------------------------------------------------------------------- one checkpoint, every engine path


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random policy as an HF dir (with its tokenizer) and as an orbax train-state checkpoint (step 3)."""
    import jax
    from flax import nnx

    from jaxrl_term.config import model_from_cfg
    from jaxrl_term.model.hf import save_pretrained
    from jaxrl_term.model.qwen3 import create_model
    from jaxrl_term.parallel.mesh import make_mesh
    from jaxrl_term.plan import compose
    from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step
    from jaxrl_term.utils.checkpoint import Checkpointer

    root = tmp_path_factory.mktemp("tiny_policy")
    arch, opts = model_from_cfg(compose([]).model)
    model = create_model(arch, opts, seed=7)
    hf = save_pretrained(model, root / "hf", "float32", tokenizer_dir=tiny_tokenizer_dir)
    mesh = make_mesh({"data": 1, "fsdp": 1, "tensor": 1}, devices=jax.devices()[:1])
    ts = make_train_step(arch, AlgoConfig(), OptimConfig(), mesh, options=opts)
    state = ts.init_state(nnx.to_pure_dict(nnx.state(model, nnx.Param)), seed=0)
    with Checkpointer(root / "run" / "checkpoints") as ck:
        ck.save(3, state, {"step": 3})
    return Path(hf), root / "run"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.docker
def test_checkpoint_embedded_served_and_orbax_give_identical_results_at_temperature_0(docker_client, tmp_path,
                                                                                      tiny_checkpoint):
    hf, run = tiny_checkpoint
    common = ["agent.max_turns=3", "agent.max_tokens_per_turn=32", "agent.max_context_tokens=4096",
              "eval.temperature=0", "eval.concurrency=1", "data.difficulties=[easy]", "data.limit=3",
              "eval.report=false", "sandbox.backend=docker", f"model.tokenizer={hf}", "rollout.jax.max_batch=2",
              "rollout.jax.max_seq_len=4096"]
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "jaxrl_term.serve", "--model-dir", str(hf), "--port", str(port),
                               "--context-length", "4096", "--enable-deterministic-inference"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=ENV)
    try:
        runs = {"hf": ["policy=checkpoint", f"policy.path={hf}", "trainer.deterministic_engine=true", "agent=tmax"],
                "orbax": ["policy=checkpoint", f"policy.path={run}", "trainer.deterministic_engine=true", "agent=tmax"]}
        results = {}
        for name, args in runs.items():
            r = _eval([*args, *common, f"run_dir={tmp_path / name}"])
            assert r.returncode == 0, (name, r.stderr[-3000:])
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        r = _eval(["policy=sglang", f"rollout.sglang.urls=[{url}]", "agent=tmax", *common,
                   f"run_dir={tmp_path / 'sglang'}"])
        assert r.returncode == 0, r.stderr[-3000:]
        # the same policy as a chat endpoint (OpenAI-compatible /v1) through a text scaffold
        r = _eval(["policy=openai", "agent=bash", f"policy.base_url={url}/v1", "policy.model=tiny",
                   "policy.api_key_env=null", *common, f"run_dir={tmp_path / 'openai'}"])
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)
    for name in ("hf", "orbax", "sglang"):
        trs = sorted(read_jsonl(tmp_path / name / "transcripts.jsonl"), key=lambda t: t["id"])
        results[name] = [(t["task"], t["pass"], t["end_reason"], t["tokens"], [u["reply"] for u in t["turns"]])
                         for t in trs]
        assert len(results[name]) == 3
    assert results["hf"] == results["orbax"], "the orbax checkpoint and the HF export are not the same policy"
    assert results["hf"] == results["sglang"], "the embedded engine and serve + SGLang client differ at temperature 0"
    assert any(len(r[4]) > 1 for r in results["hf"])  # multi-turn: observations went back to the model
    chat = read_jsonl(tmp_path / "openai" / "transcripts.jsonl")
    assert len(chat) == 3 and all(t["turns"] and t["end_reason"] in ("no_action", "max_turns", "parse_errors",
                                                                      "finished") for t in chat), chat
    assert _summary(tmp_path / "orbax")["step"] == 3


# ------------------------------------------------------------------------------- during training


@pytest.mark.docker
def test_training_evaluates_heldout_tasks_and_saves_readable_transcripts(docker_client, tmp_path):
    out = tmp_path / "run"
    args = ["+experiment=tiny_cpu", "trainer.warm_start.enabled=false", "agent.max_turns=2",
            "agent.max_tokens_per_turn=24", "trainer.groups_per_step=2", "algo.group_size=2",
            "trainer.drop_zero_variance=false", "logging.console=false", "rollout.jax.max_seq_len=2048",
            "trainer.buckets=[1024,2048]", "agent.max_context_tokens=2048", "trainer.steps=2",
            "trainer.eval_before_train=true",
            "trainer.eval_every=2", "eval.data.limit=2", "trainer.report=false", "sandbox.backend=docker",
            f"run_dir={out}"]
    r = run_stacked([sys.executable, "-m", "jaxrl_term.train", *args], cwd=REPO, timeout=840, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = read_jsonl(out / "metrics.jsonl")
    evals = {m["step"]: m for m in lines if "eval/pass@1" in m}
    assert sorted(evals) == [0, 2]
    assert [m["step"] for m in lines] == sorted(m["step"] for m in lines)  # wandb's steps only move forward
    for step, m in evals.items():
        s = _summary(out / "eval" / f"step_{step:06d}")
        assert m["eval/pass@1"] == s["pass@1"] and s["tasks"] == 2 and s["step"] == step
        assert 0.0 <= s["pass@1"] <= 1.0
    trained = {tid for m in lines for tid in m.get("task_ids", [])}
    heldout = {t["task"] for t in read_jsonl(out / "eval" / "step_000000" / "transcripts.jsonl")}
    assert trained and len(heldout) == 2 and not heldout & trained  # never evaluated on a training task
    for step in (0, 1):  # every episode of the step (2 groups x 2), readable, with token ids kept apart
        trs = read_jsonl(out / "trajectories" / f"step_{step:06d}.jsonl")
        toks = read_jsonl(out / "trajectories" / f"step_{step:06d}.tokens.jsonl")
        assert len(trs) == len(toks) == 4
        assert [t["id"] for t in trs] == [t["id"] for t in toks]
        for t in trs:
            assert "token_ids" not in t and t["instruction"] and t["turns"] and "advantage" in t
            assert t["reward_parts"]["outcome"] == "scored" and isinstance(t["tests"], dict) and t["tests"]
            assert t["step"] == step
        assert all(len(k["token_ids"]) == len(k["loss_mask"]) for k in toks)
        md = to_markdown(trs[0])
        assert trs[0]["instruction"][:40] in md and "Turn 0" in md
    ws = [m for m in lines if m["step"] == -1]
    assert not ws  # the warm start is off here
    # a few transcripts as text in TensorBoard (the tags are in the event file's records)
    events = b"".join(f.read_bytes() for f in (out / "tensorboard").iterdir())
    assert b"episodes/0" in events and b"eval/0" in events and b"eval/pass_1" in events  # TensorBoard: no "@"


def test_openai_chat_engine_retries_429_and_5xx_but_not_a_bad_request(tiny_tokenizer_dir):
    """Against a local HTTP server: 429 (Retry-After) and 503 are retried, the answer's text comes back with ids
    under our tokenizer closed by <|im_end|>; a 400 is the request's fault and is raised at once."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.rollout.engine import EngineError, SamplingParams
    from jaxrl_term.rollout.openai_chat import OpenAIChatEngine

    script = [(429, {"Retry-After": "0"}), (503, {}), (200, {})]
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append({"body": body, "auth": self.headers.get("Authorization")})
            status, headers = script.pop(0) if script else (400, {})
            payload = {"choices": [{"message": {"role": "assistant", "content": "```bash\nls <|im_end|>\n```"},
                                    "finish_reason": "stop"}]} if status == 200 else {"error": "no"}
            data = json.dumps(payload).encode()
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    tok = load_tokenizer(tiny_tokenizer_dir)
    eng = OpenAIChatEngine(f"http://127.0.0.1:{srv.server_address[1]}/v1", "m", tok, api_key="k", backoff_s=0.01)

    async def go():
        msgs = [{"role": "user", "content": "hi"}]
        gen = await eng.chat(msgs, SamplingParams(temperature=0.0, max_new_tokens=64, seed=5))
        with pytest.raises(EngineError) as e:
            await eng.chat(msgs, SamplingParams(max_new_tokens=8))
        await eng.aclose()
        return gen, e.value

    try:
        gen, err = asyncio.run(go())
    finally:
        srv.shutdown()
    assert gen.text == "```bash\nls <|im_end|>\n```" and gen.finish_reason == "stop"
    assert gen.output_ids[-1] == eng.eos_id and gen.output_ids.count(eng.eos_id) == 1  # the text's is plain text
    assert len(seen) == 4 and not err.retryable and "HTTP 400" in str(err)
    assert seen[0]["auth"] == "Bearer k" and seen[0]["body"]["seed"] == 5 and seen[0]["body"]["max_tokens"] == 64


def test_a_chat_endpoint_that_keeps_failing_is_an_engine_error_and_a_full_context_is_scored(tiny_tokenizer_dir):
    """Through the agent loop in a real (local) sandbox: an endpoint that answers 503 until the episode's time
    runs out ends the episode as an engine error (retried or dropped by the evaluator), not as the agent's
    timeout (scored 0); a 400 saying the conversation exceeds the model's context ends it as context_full."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from jaxrl_term.agent.actions import make_scaffold
    from jaxrl_term.agent.loop import AgentLimits, run_episode
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.rollout.openai_chat import OpenAIChatEngine
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.env import open_task_sandbox

    mode = {"answer": (503, {"error": "overloaded"})}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's naming
            self.rfile.read(int(self.headers["Content-Length"]))
            status, payload = mode["answer"]
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    tok = load_tokenizer(tiny_tokenizer_dir)
    task = generate("sed_config", "easy", seed=1)

    async def episode(limits):
        eng = OpenAIChatEngine(f"http://127.0.0.1:{srv.server_address[1]}/v1", "m", tok, backoff_s=0.2,
                               max_retries=50)
        try:
            async with open_task_sandbox(task, backend="local") as sb:
                return await run_episode(task, eng, sb, tok, make_scaffold("bash"), limits=limits)
        finally:
            await eng.aclose()

    try:
        t0 = time.monotonic()
        stalled = asyncio.run(episode(AgentLimits(trajectory_timeout_s=2.0, max_context_tokens=4096)))
        took = time.monotonic() - t0
        mode["answer"] = (400, {"error": {"code": "context_length_exceeded", "message": "This model's maximum "
                                          "context length is 4096 tokens. However, you requested 5000 tokens."}})
        full = asyncio.run(episode(AgentLimits(max_context_tokens=4096)))
        mode["answer"] = (400, {"error": {"message": "temperature must be >= 0"}})
        bad = asyncio.run(episode(AgentLimits(max_context_tokens=4096)))
    finally:
        srv.shutdown()
    assert stalled.end_reason == "engine_error" and not stalled.valid and "HTTP 503" in stalled.error, stalled.error
    assert took < 30  # ended at the deadline, not after the 50 retries
    assert full.end_reason == "context_full" and full.valid and not full.turns
    assert bad.end_reason == "engine_error" and "HTTP 400" in bad.error


def test_restart_counts_each_dropped_attempt_once_and_forgets_those_finished_since(tmp_path):
    """invalid.jsonl after a restart: one record per attempt still unfinished (the last), none for an attempt that
    finished on a later try; transcripts of attempts with no finished record are removed."""
    from jaxrl_term.agent.transcript import write_jsonl
    from jaxrl_term.eval.core import EvalSettings, Evaluator
    from jaxrl_term.tasks.builtin import generate

    task = generate("sed_config", "easy", seed=1)
    ev = Evaluator([task], tmp_path, policy="nop", settings=EvalSettings(attempts=3, progress=False))
    t = task.id
    write_jsonl(tmp_path / "attempts.jsonl", [{"id": f"{t}/attempt-0", "task": t, "attempt": 0, "pass": False,
                                               "failure": "tests_failed", "reward": 0.0}])
    with open(tmp_path / "attempts.jsonl", "a") as f:
        f.write('{"id": "cut by a kill", "ta')
    write_jsonl(tmp_path / "invalid.jsonl", [
        {"task": t, "attempt": 0, "failure": "sandbox_error"},  # finished on a later run
        {"task": t, "attempt": 1, "failure": "sandbox_error"},
        {"task": t, "attempt": 1, "failure": "engine_error"}])  # the same attempt dropped twice: counted once
    write_jsonl(tmp_path / "transcripts.jsonl", [{"id": f"{t}/attempt-0"}, {"id": f"{t}/attempt-2"}])
    done = ev._load()
    assert done == {(t, 0)}
    assert [(r["attempt"], r["failure"]) for r in ev.invalid] == [(1, "engine_error")]
    assert [(r["attempt"], r["failure"]) for r in read_jsonl(tmp_path / "invalid.jsonl")] == [(1, "engine_error")]
    assert [r["id"] for r in read_jsonl(tmp_path / "transcripts.jsonl")] == [f"{t}/attempt-0"]
    assert (tmp_path / "attempts.jsonl").read_text().count("\n") == 1  # the cut line is gone
    s = summarize(ev.records, 3, tasks=[task], invalid=ev.invalid)
    assert s["attempts_invalid"] == 1 and s["failure_modes"] == {"tests_failed": 1, "engine_error": 1}


def test_a_resumed_run_sets_aside_evaluations_made_after_its_checkpoint(tmp_path):
    """Killed between the evaluation at step 3 and the checkpoint at step 3, a run resumes at step 2: the
    evaluation of weights it no longer has is moved to eval/stale/, so none of its attempts is reused."""
    from types import SimpleNamespace

    from jaxrl_term.train import Trainer

    for step in (0, 2, 3):
        (tmp_path / "eval" / f"step_{step:06d}").mkdir(parents=True)
        (tmp_path / "eval" / f"step_{step:06d}" / "attempts.jsonl").write_text("{}\n")
    Trainer.set_aside_later_evals(SimpleNamespace(run_dir=tmp_path, start_step=2))
    assert sorted(p.name for p in (tmp_path / "eval").glob("step_*")) == ["step_000000", "step_000002"]
    (stale,) = (tmp_path / "eval" / "stale").iterdir()
    assert stale.name.startswith("step_000003.") and (stale / "attempts.jsonl").is_file()


@pytest.mark.docker
def test_an_eval_attempt_that_hangs_past_its_deadline_is_retried_and_leaves_no_container(docker_client, tmp_path,
                                                                                        monkeypatch, caplog):
    """A try whose verifier never answers is cut at the attempt's deadline, its container removed, and retried:
    the attempt is scored by the retry (the nop policy's real 0), with no invalid record; a deadline every try
    passes drops the attempt as ``attempt_deadline``, never as a 0. Without an override the deadline is the
    training rollouts' formula (image build + agent time + 3 verifier runs + margin)."""
    import asyncio

    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.eval.core import EvalSettings, Evaluator
    from jaxrl_term.reward import verifier
    from jaxrl_term.rollout.pipeline import ATTEMPT_MARGIN_S
    from jaxrl_term.sandbox.docker import LABEL_PID
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.env import open_task_sandbox

    task = generate("sort_uniq", "easy", seed=3)
    rest = task.agent_timeout_s + 3 * task.test_timeout_s + ATTEMPT_MARGIN_S
    assert Evaluator([task], tmp_path / "f", policy="nop", settings=EvalSettings()).attempt_deadline(task) == (
        task.environment.build_timeout_s + rest)
    limited = Evaluator([task], tmp_path / "f", policy="checkpoint", settings=EvalSettings(), engine=object(),
                        tokenizer=object(), scaffold_factory=object, limits=AgentLimits(trajectory_timeout_s=50.0))
    assert limited.attempt_deadline(task) == task.environment.build_timeout_s + 50.0 + rest - task.agent_timeout_s

    real_verify, calls = verifier.verify, []

    async def verify_hanging(*a, **kw):
        calls.append(1)
        if len(calls) in hang_on:
            await asyncio.Event().wait()  # never set
        return await real_verify(*a, **kw)

    monkeypatch.setattr(verifier, "verify", verify_hanging)

    def mine():
        return [c.name for c in docker_client.containers.list(all=True, filters={"label": "jaxrl_term.eval"})
                if (c.labels or {}).get(LABEL_PID) == str(os.getpid())]

    async def build_first():  # the task's image is built before any clock runs
        async with open_task_sandbox(task, backend="docker"):
            pass

    asyncio.run(build_first())
    hang_on = {1}
    ev = Evaluator([task], tmp_path / "once", policy="nop", settings=EvalSettings(
        attempt_deadline_s=20.0, max_retries=1, progress=False))
    t0 = time.monotonic()
    with caplog.at_level("WARNING", logger="jaxrl_term"):
        summary = asyncio.run(ev.run())
    assert time.monotonic() - t0 >= 20.0 and len(calls) == 2
    assert summary["attempts_invalid"] == 0 and summary["pass@1"] == 0.0
    rec, = read_jsonl(tmp_path / "once" / "attempts.jsonl")
    assert rec["retries"] == 1 and rec["outcome"] == "scored" and rec["failure"] == "tests_failed"
    assert any("passed its deadline of 20 s while running the verifier" in r.getMessage() for r in caplog.records)
    assert mine() == []

    calls.clear()
    hang_on = {1, 2}
    ev = Evaluator([task], tmp_path / "always", policy="nop", settings=EvalSettings(
        attempt_deadline_s=15.0, max_retries=1, progress=False))
    summary = asyncio.run(ev.run())
    assert len(calls) == 2 and summary["attempts_invalid"] == 1
    assert summary["failure_modes"] == {"attempt_deadline": 1}
    assert not (tmp_path / "always" / "attempts.jsonl").exists() or not read_jsonl(tmp_path / "always" / "attempts.jsonl")
    bad, = read_jsonl(tmp_path / "always" / "invalid.jsonl")
    assert bad["failure"] == "attempt_deadline" and "running the verifier" in bad["error"]
    assert mine() == []
