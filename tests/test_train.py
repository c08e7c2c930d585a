"""The training program: presets, config errors, an end-to-end tiny run with async rollouts, resume after
SIGKILL, and faults in the rollout pipeline (real sandboxes; only the LLM is scripted where noted)."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from conftest import REPO, run_stacked
from helpers import SessionEngine
from jaxrl_term.config import register

CLUSTER = ["qwen3_8b_a100x2", "qwen32b_h100x16", "qwen32b_h100", "tmax_qwen3_8b"]
PRESETS = ["tiny_cpu", "tiny_learn", *CLUSTER]
# a tiny run that needs no warm start: a random policy, short episodes, the local sandbox backend
QUICK = ["+experiment=tiny_cpu", "trainer.warm_start.enabled=false", "agent.max_turns=2",
         "agent.max_tokens_per_turn=24", "trainer.groups_per_step=2", "algo.group_size=2", "sandbox.backend=local",
         "trainer.drop_zero_variance=false", "logging.tensorboard=false", "logging.console=false",
         "rollout.jax.max_seq_len=2048", "trainer.buckets=[1024,2048]", "agent.max_context_tokens=2048", "trainer.eval_every=0",
         "trainer.eval_before_train=false", "trainer.report=false"]


def compose_preset(name, overrides=()):
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"+experiment={name}", *overrides])


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_composes(name):
    cfg = compose_preset(name)
    assert OmegaConf.to_yaml(cfg)
    proc = subprocess.run([sys.executable, "-m", "jaxrl_term.train", f"+experiment={name}", "--cfg", "job"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("name", CLUSTER)
def test_cluster_presets_fit_their_hardware(name, tmp_path):
    """Topology by hand; memory by the planner (the real step compiled on fake devices, XLA's buffer assignment)."""
    cfg = compose_preset(name)
    cl = cfg.trainer.cluster
    devices = cl.nodes * cl.gpus_per_node
    shape = cfg.mesh.shape
    assert shape.data * shape.fsdp * shape.tensor == devices and -1 not in shape.values()
    heads, kv = cfg.model.num_attention_heads, cfg.model.num_key_value_heads
    la = cfg.rollout.sglang.launch
    assert cfg.rollout.engine == "sglang" and la.enabled and la.servers
    used: list[int] = []
    for s in la.servers:
        gpus = [int(g) for g in s.gpus.split(",")]
        assert len(gpus) == s.tp_size and all(0 <= g < cl.gpus_per_node for g in gpus)
        assert kv % s.tp_size == 0 and heads % s.tp_size == 0  # SGLang's tensor parallelism splits the heads
        used += gpus
    assert len(used) == len(set(used)) <= cl.gpus_per_node  # servers on one node do not share a GPU
    out = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "jaxrl_term.plan", f"+experiment={name}", "--no-flops", "--json",
                           str(out)], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0 and "FITS" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    # >= 10% of each GPU free in every phase (update, rollout, weight sync), runtime overheads counted
    assert plan["fits"] and [p["name"] for p in plan["phases"]] == ["update", "rollout", "weight sync"]
    assert all(p["slack"] >= 0.10 for p in plan["phases"]), plan["phases"]
    assert plan["train"]["peak_gb"] + 1.0 <= plan["colocation"]["trainer_budget_gb"]  # + XLA's runtime
    assert all(s["full_contexts"] >= 1 for s in plan["servers"])  # at least one full context per server
    assert "runtime overheads" in proc.stdout and "full contexts in KV" in proc.stdout


def _train(args, cwd=REPO, timeout=600, **popen):
    env = {**os.environ, "XLA_FLAGS": ""}
    return run_stacked([sys.executable, "-m", "jaxrl_term.train", *args], cwd=cwd, timeout=timeout, env=env, **popen)


def test_bad_config_fails_before_any_work_naming_the_key(tmp_path):
    cases = [
        (["trainer.stepz=3"], "trainer.stepz"),
        (["trainer.steps=abc"], "full_key: trainer.steps"),
        (["+experiment=qwen32b_h100"], "model.path"),
        (["+experiment=tmax_qwen3_8b", "model.path=/m"], "data.source"),
        (["+experiment=tiny_learn", "trainer.buckets=[1024,2048]"], "largest length bucket (2048) is shorter"),
        (["+experiment=tiny_cpu", "data.curriculum.enabled=true", "data.curriculum.band=[0.9,0.1]"],
         "data.curriculum.band"),
    ]
    import importlib.util

    if importlib.util.find_spec("wandb") is None:  # the extra is not part of the test environment
        cases.append((["+experiment=tiny_cpu", "logging.wandb.enabled=true"], "pip install -e '.[wandb]'"))
    bad = tmp_path / "conf" / "experiment"
    bad.mkdir(parents=True)
    (bad / "broken.yaml").write_text("# @package _global_\ndefaults:\n  - override /model: qwen3_99b\n")
    cases.append(([f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "+experiment=broken"], "model/qwen3_99b"))
    for args, needle in cases:
        t0 = time.monotonic()
        proc = _train([*args, f"run_dir={tmp_path / 'never'}"], timeout=120)
        assert proc.returncode != 0 and needle in proc.stdout + proc.stderr, (args, proc.stderr[-1500:])
        assert time.monotonic() - t0 < 60 and not (tmp_path / "never" / "checkpoints").exists()


def test_tiny_run_end_to_end_with_async_rollouts(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train([*QUICK, "trainer.steps=3", "trainer.max_off_policy_steps=1", "trainer.checkpoint_every=1",
                   f"run_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if m["step"] >= 0]
    assert [m["step"] for m in steps] == [0, 1, 2]
    for m in steps:
        assert m["batch/version_lag_max"] <= 1  # no batch older than the bound reached the trainer
        assert {"reward/mean", "train/loss", "train/grad_norm", "time/update_s", "time/rollout_wait_s"} <= set(m)
        assert m["train/logp_gap_max"] < 1e-3  # engine and trainer score the same distribution
    assert any(m["time/overlap_s"] > 0 for m in steps)  # rollouts ran during updates
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())[-1] == "3"
    sample = json.loads((run_dir / "trajectories" / "step_000002.jsonl").read_text().splitlines()[0])
    assert sample["instruction"] and sample["turns"] and "token_ids" not in sample  # readable, ids kept apart
    toks = json.loads((run_dir / "trajectories" / "step_000002.tokens.jsonl").read_text().splitlines()[0])
    assert toks["id"] == sample["id"] and len(toks["token_ids"]) == len(toks["loss_mask"]) == sample["tokens"]
    assert 0 < sum(toks["loss_mask"]) == sample["policy_tokens"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoints"] and Path(summary["hf_final"], "config.json").is_file()


def test_sigkill_then_resume_continues_with_the_same_tasks_and_params(tmp_path):
    """With the curriculum sampler on (its draws depend on the pass rates observed before the kill, saved in the
    checkpoint): the resumed run restores the params, draws the same next tasks and makes the same next update."""
    common = [*QUICK, "trainer.steps=3", "trainer.checkpoint_every=1", "trainer.deterministic_engine=true",
              "trainer.log_param_digest=true", "data.curriculum.enabled=true"]
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a = _train([*common, f"run_dir={a_dir}"], timeout=280)  # ~30 s each here; three runs within the test's 900 s
    assert a.returncode == 0, a.stderr[-3000:]
    env = {**os.environ, "XLA_FLAGS": ""}
    b = subprocess.Popen([sys.executable, "-m", "jaxrl_term.train", *common, f"run_dir={b_dir}"], cwd=REPO, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = b_dir / "checkpoints" / "1"
    deadline = time.monotonic() + 280
    while not (ckpt.is_dir() and any(ckpt.iterdir())) and b.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # let the asynchronous checkpoint commit
    os.killpg(b.pid, signal.SIGKILL)
    b.wait(timeout=60)
    steps_before = [json.loads(x)["step"] for x in (b_dir / "metrics.jsonl").read_text().splitlines()]
    assert 0 in steps_before and 2 not in steps_before  # it really died mid-run
    b2 = _train([*common, f"run_dir={b_dir}"], timeout=280)
    assert b2.returncode == 0, b2.stderr[-3000:]
    am = {m["step"]: m for m in map(json.loads, (a_dir / "metrics.jsonl").read_text().splitlines())}
    bm = [json.loads(x) for x in (b_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = [m for m in bm if "resume/params_digest" in m]
    assert resumed, "the restarted run did not resume from a checkpoint"
    start = resumed[-1]["step"] + 1
    assert resumed[-1]["resume/params_digest"] == am[start - 1]["params_digest"]  # restored params
    after = [m for m in bm if m["step"] >= start and "task_ids" in m]
    assert after[0]["step"] == start and after[0]["task_ids"] == am[start]["task_ids"]  # the same next tasks
    assert after[0]["params_digest"] == am[start]["params_digest"]  # and the same next update
    assert am[2]["curriculum/tasks_seen"] >= 1  # the curriculum had observations to lose


# -------------------------------------------------------------------------------------- pipeline faults


def test_pipeline_retries_or_drops_failed_episodes_and_goes_on(docker_client, tiny_tokenizer_dir):
    from dataclasses import replace

    from jaxrl_term.agent.actions import SENTINEL, BashScaffold
    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.rollout.pipeline import RolloutPipeline
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.task import FileBlob, Tests

    tok = load_tokenizer(tiny_tokenizer_dir)
    good = generate("create_file", "easy", seed=2)
    broken = replace(generate("create_file", "easy", seed=3),
                     tests=Tests("pytest", {"test_outputs.py": FileBlob.text("# no tests\n")}, "test_outputs.py"))
    engine = SessionEngine(tok, ["```bash\nsleep 3; echo working\n```", f"```bash\necho {SENTINEL}\n```"],
                           fail_calls={2, 5})

    async def main():
        pipe = RolloutPipeline([good, broken], engine=engine, tokenizer=tok, scaffold_factory=BashScaffold,
                               group_size=2, groups_per_step=2, sampling=SamplingParams(max_new_tokens=64),
                               limits=AgentLimits(max_turns=3, max_context_tokens=4096), backend="docker",
                               max_episode_retries=2, drop_zero_variance=False, max_concurrent_episodes=4)
        pipe.start()

        async def kill_one_container():  # a sandbox dies mid-episode
            import docker

            c = docker.from_env()
            for _ in range(100):
                running = c.containers.list(filters={"label": "jaxrl_term.group"})
                if running:
                    await asyncio.sleep(1.0)
                    try:
                        running[0].remove(force=True)
                        return True
                    except docker.errors.NotFound:
                        continue  # its episode ended in the meantime: kill the next one
                await asyncio.sleep(0.1)
            return False

        killer = asyncio.create_task(kill_one_container())
        try:
            batch = await asyncio.wait_for(pipe.get_batch(0), 300)
        finally:
            await pipe.stop()
        return batch, pipe.take_counters(), await killer

    batch, counters, killed = asyncio.run(main())
    assert killed
    assert [g.task.id for g in batch] == [good.id, good.id]  # the run went on with the good task
    assert all(len(g.trajectories) == 2 and g.rewards == [0.0, 0.0] for g in batch)
    assert counters.get("pipeline/retry_engine_error", 0) >= 1  # engine errors were retried
    assert counters.get("pipeline/retry_sandbox_error", 0) + counters.get("pipeline/retry_sandbox_exception", 0) >= 1
    assert counters.get("pipeline/retry_verifier_error", 0) >= 3  # the broken task's verifier, retried ...
    assert counters.get("pipeline/groups_dropped_errors", 0) >= 1  # ... and its group dropped


def test_an_attempt_that_hangs_past_its_deadline_is_dropped_and_retried(docker_client, tiny_tokenizer_dir,
                                                                         monkeypatch, caplog):
    """A part of an episode that hangs where no limit of its own applies (here the verifier's first call never
    returns: the stand-in for an engine API call that never answers) is cut off at the attempt's deadline: the
    attempt is dropped (never scored), the episode is retried, the group gets the real verifier's rewards, the
    hung attempt's sandbox is closed, and the log says where it hung."""
    import docker

    import jaxrl_term.rollout.pipeline as pipeline
    from jaxrl_term.agent.actions import SENTINEL, BashScaffold
    from jaxrl_term.agent.loop import AgentLimits
    from jaxrl_term.model.tokenizer import load_tokenizer
    from jaxrl_term.rollout.engine import SamplingParams
    from jaxrl_term.tasks.builtin import generate
    from jaxrl_term.tasks.env import open_task_sandbox

    tok = load_tokenizer(tiny_tokenizer_dir)
    task = generate("create_file", "easy", seed=2)
    real_verify, calls = pipeline.verify, []

    async def verify_hanging_once(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            await asyncio.Event().wait()  # never set
        return await real_verify(*a, **kw)

    monkeypatch.setattr(pipeline, "verify", verify_hanging_once)
    engine = SessionEngine(tok, [f"```bash\necho {SENTINEL}\n```"])
    seen_open: list[int] = []

    async def main():
        async with open_task_sandbox(task, backend="docker"):  # the task's image built before any clock runs
            pass
        pipe = pipeline.RolloutPipeline(
            [task], engine=engine, tokenizer=tok, scaffold_factory=BashScaffold, group_size=2, groups_per_step=1,
            sampling=SamplingParams(max_new_tokens=64), limits=AgentLimits(max_turns=2, max_context_tokens=4096),
            backend="docker", drop_zero_variance=False, attempt_deadline_s=30.0)
        # without the override: the task image's build (until the sandbox is open) + the agent's time + 3 verifier
        # runs + the margin
        pipe._attempt_deadline_s, pipe.limits = None, AgentLimits(trajectory_timeout_s=50.0)
        rest = 50.0 + 3 * task.test_timeout_s + pipeline.ATTEMPT_MARGIN_S
        assert pipe.attempt_deadline(task, opened=True) == rest
        assert pipe.attempt_deadline(task) == task.environment.build_timeout_s + rest
        pipe._attempt_deadline_s, pipe.limits = 30.0, AgentLimits(max_turns=2, max_context_tokens=4096)
        pipe.start()

        async def count_open():  # the hung attempt's container while it hangs
            c = docker.from_env()
            while True:
                seen_open.append(len(c.containers.list(filters={"label": "jaxrl_term.group"})))
                await asyncio.sleep(1.0)

        watcher = asyncio.create_task(count_open())
        t0 = time.monotonic()
        try:
            batch = await asyncio.wait_for(pipe.get_batch(0), 240)
        finally:
            watcher.cancel()
            await pipe.stop()
        return batch, pipe.take_counters(), time.monotonic() - t0

    with caplog.at_level("ERROR", logger="jaxrl_term"):
        batch, counters, took = asyncio.run(main())
    assert took >= 30.0 and len(calls) == 3  # the hung call, the retried attempt's, the other episode's
    assert counters.get("pipeline/retry_attempt_deadline") == 1 and counters["pipeline/episodes"] == 2
    assert len(batch) == 1 and len(batch[0].trajectories) == 2
    assert all(t.reward_parts["outcome"] != "tampered" for t in batch[0].trajectories)
    assert batch[0].rewards == [0.0, 0.0]  # the agent only said it was done: the real verifier's 0s
    assert [t.meta["attempt"] for t in batch[0].trajectories].count(1) == 1  # one episode needed a retry
    assert any("passed its deadline of 30 s while running the verifier" in r.getMessage() for r in caplog.records)
    assert max(seen_open) >= 1
    assert not docker.from_env().containers.list(filters={"label": "jaxrl_term.group"})  # the hung one closed too


def test_hydra_sweep_runs_each_job_in_its_own_dir(tmp_path):
    proc = _train(["-m", *QUICK, "algo=grpo,dppo", "trainer.steps=0", f"hydra.sweep.dir={tmp_path}"], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [OmegaConf.load(tmp_path / str(k) / "config.yaml").algo.loss for k in (0, 1)]
    assert losses == ["ppo_clip", "dppo"]


def test_runs_are_named_and_leave_nothing_elsewhere(tmp_path):
    """run_name=NAME -> runs/NAME (Hydra's .hydra/ and train.log inside it); run_dir=DIR -> everything in DIR and
    no stray runs/<time>/; a sweep with run_name -> runs/multirun/NAME/<n>."""
    proc = _train([*QUICK, "trainer.steps=0", "run_name=exp1"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "exp1"
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["exp1"]
    assert (run / "config.yaml").is_file() and (run / ".hydra" / "config.yaml").is_file() and (run / "train.log").is_file()
    assert OmegaConf.load(run / "config.yaml").run_dir == str(run)
    proc = _train([*QUICK, "trainer.steps=0", f"run_dir={tmp_path / 'elsewhere'}"], cwd=tmp_path / "runs", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["exp1"]  # no runs/runs/<time>
    assert (tmp_path / "elsewhere" / ".hydra").is_dir() and (tmp_path / "elsewhere" / "train.log").is_file()
    proc = _train(["-m", *QUICK, "trainer.steps=0", "run_name=sw", "seed=1,2"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all((tmp_path / "runs" / "multirun" / "sw" / k / "config.yaml").is_file() for k in ("0", "1"))
    bad = _train([*QUICK, "run_name=a/b"], cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "run_name" in bad.stderr
