"""No run may look healthy while it learns nothing, and every bad setting fails before work starts.

Each test states one defect of issue 14 and fails on the old behaviour."""

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from conftest import REPO, run_stacked
from jaxrl_term.rl.batch import Sample, make_batch
from jaxrl_term.rl.losses import ppo_clip_fraction
from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step
from test_rl_step import CFG, OPTIM, leaves, params0, samples


def _train(args, timeout=600, cwd=REPO):
    env = {**os.environ, "XLA_FLAGS": ""}
    return run_stacked([sys.executable, "-m", "jaxrl_term.train", *args], cwd=cwd, timeout=timeout, env=env)


# ------------------------------------------------------------------------------------------------ 1. TIS


def test_tis_without_recomputed_old_policy_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match="recompute_old_logp=true"):
        AlgoConfig(tis_cap=2.0)
    with pytest.raises(ValueError, match="recompute_old_logp=true"):
        AlgoConfig(tis_cap=2.0, use_old_logp=True)
    with pytest.raises(ValueError, match="recompute_old_logp"):
        AlgoConfig(epochs=2, use_old_logp=True)  # the old check only looked at use_old_logp
    with pytest.raises(ValueError, match="changes nothing"):
        AlgoConfig(use_old_logp=True)


def test_tis_weights_differ_from_one_when_engine_and_trainer_disagree():
    """With the old policy recomputed, the TIS weight min(exp(old - mu), C) sees the engine/trainer gap."""
    algo = AlgoConfig(tis_cap=2.0, use_old_logp=True, recompute_old_logp=True)
    ts = make_train_step(CFG, algo, OPTIM)
    state = ts.init_state(params0())
    batch = make_batch(samples(8, seed=4), buckets=(32,))
    trainer_lp = ts.logprobs(state.params, batch)[0]
    # the "engine" reports log-probs 0.5 nats below the trainer's on every policy token: exp(0.5) = 1.65 < cap
    batch = batch.replace(rollout_logp=np.where(batch.loss_mask > 0, trainer_lp - 0.5, 0.0).astype(np.float32))
    _, hist = ts.update(state, batch)
    assert hist[0]["tis_weight"] == pytest.approx(np.exp(0.5), rel=1e-3)
    assert hist[0]["logp_gap_mean"] == pytest.approx(0.5, rel=1e-3)


# ----------------------------------------------------------------------------------- 4. the gap's meaning


def test_gap_and_mismatch_kl_are_measured_on_fresh_rows_only():
    """Rows sampled by older weights carry policy drift, not numerics: they do not enter the gap."""
    ts = make_train_step(CFG, AlgoConfig(), OPTIM)
    state = ts.init_state(params0())
    ss = samples(8, seed=5)
    probe = make_batch(ss, buckets=(32,))
    lp = ts.logprobs(state.params, probe)[0]
    exact = [Sample(s.tokens, s.loss_mask, lp[i, :len(s.tokens)].tolist(), s.advantage, fresh=i % 2 == 0)
             for i, s in enumerate(ss)]
    stale = [Sample(s.tokens, s.loss_mask, (np.where(np.array(s.loss_mask) > 0, lp[i, :len(s.tokens)] - 3.0, 0.0)
                                            ).tolist(), s.advantage, fresh=False) if i % 2 else s
             for i, s in enumerate(exact)]
    _, m = ts(state, make_batch(stale, buckets=(32,)))
    assert m["logp_gap_mean"] < 1e-5 and m["mismatch_kl"] < 1e-6  # the 3-nat lagged rows are left out
    assert m["fresh_tokens"] == sum(sum(s.loss_mask) for i, s in enumerate(ss) if i % 2 == 0)
    everything = [Sample(s.tokens, s.loss_mask, s.rollout_logprobs, s.advantage, fresh=True) for s in stale]
    _, m2 = ts(ts.init_state(params0()), make_batch(everything, buckets=(32,)))
    assert m2["logp_gap_mean"] > 1.0 and m2["mismatch_kl"] > 0.5  # the same rows counted as fresh


# --------------------------------------------------------------------------------- 5. no learning signal


def test_a_batch_with_no_learning_signal_leaves_params_and_optimizer_bit_identical():
    ts = make_train_step(CFG, AlgoConfig(), OptimConfig(lr=1e-3, weight_decay=0.1))
    state = ts.init_state(params0())
    p0, o0 = leaves(state.params), leaves(state.opt_state)
    zero = make_batch([Sample(s.tokens, s.loss_mask, s.rollout_logprobs, 0.0) for s in samples(8)], buckets=(32,))
    state, m = ts(state, zero)
    assert m["skipped"] == 1.0 and m["no_signal"] == 1.0 and m["signal_tokens"] == 0
    for a, b in zip(p0 + o0, leaves(state.params) + leaves(state.opt_state), strict=True):
        np.testing.assert_array_equal(a, b)  # AdamW momentum and decay did not move anything
    state, m = ts(state, make_batch(samples(8), buckets=(32,)))
    assert m["skipped"] == 0.0
    assert any(not np.array_equal(a, b) for a, b in zip(p0, leaves(state.params)))


def test_a_run_that_never_learns_stops_after_max_consecutive_skips(tmp_path):
    """A random tiny policy never solves a task: every group has equal rewards, every update is skipped."""
    quick = ["+experiment=tiny_cpu", "trainer.warm_start.enabled=false", "agent.max_turns=1",
             "agent.max_tokens_per_turn=8", "trainer.groups_per_step=1", "algo.group_size=2", "sandbox.backend=local",
             "trainer.drop_zero_variance=false", "logging.tensorboard=false", "logging.console=false",
             "rollout.jax.max_seq_len=2048", "trainer.buckets=[1024,2048]", "agent.max_context_tokens=2048",
             "trainer.steps=10",
             "trainer.max_consecutive_skips=2", "trainer.eval_before_train=false", "trainer.eval_every=0",
             "trainer.report=false", f"run_dir={tmp_path / 'run'}"]
    proc = _train(quick)
    assert proc.returncode != 0
    assert "no update was applied in 2 consecutive steps" in proc.stderr + proc.stdout
    assert "non-zero advantage" in proc.stderr + proc.stdout
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/consecutive_skips"] for m in steps if m["step"] >= 0] == [1]  # aborted during the 2nd step


# --------------------------------------------------------------------------------------- 8. metrics


def test_clip_fraction_counts_dual_clipped_tokens_and_dual_clip_must_exceed_one():
    logp = np.log(np.array([[4.0, 1.0, 0.5]], np.float32))
    old = np.zeros((1, 3), np.float32)
    adv = np.array([[-1.0, -1.0, -1.0]], np.float32)
    # r = 4 with A < 0 and dual clip 3: the loss is the constant -3 A (no gradient): clipped
    frac = np.asarray(ppo_clip_fraction(logp, old, adv, 0.2, 0.28, dual_clip=3.0))
    np.testing.assert_array_equal(frac, [[True, False, True]])
    with pytest.raises(ValueError, match="dual_clip"):
        AlgoConfig(dual_clip=1.0)


def test_logged_lr_follows_the_optimizers_count_not_skipped_calls():
    optim = OptimConfig(lr=1e-2, schedule="warmup_constant", warmup_steps=10, weight_decay=0.0)
    ts = make_train_step(CFG, AlgoConfig(), optim)
    state = ts.init_state(params0())
    zero = make_batch([Sample(s.tokens, s.loss_mask, s.rollout_logprobs, 0.0) for s in samples(4)], buckets=(32,))
    real = make_batch(samples(4), buckets=(32,))
    state, m0 = ts(state, zero)  # skipped: optax's count stays 0
    state, m1 = ts(state, real)  # the first applied update, at count 0
    state, m2 = ts(state, real)
    assert m0["lr"] == m1["lr"] == pytest.approx(0.0)
    assert m2["lr"] == pytest.approx(1e-2 / 10)
    assert int(jax.device_get(state.step)) == 3


# ---------------------------------------------------------------------------- 6, 7, 9. preflight and CLIs


def test_bad_settings_fail_in_one_pass_before_any_work_and_leave_no_run_dir(tmp_path):
    run_dir = tmp_path / "never"
    t0 = time.monotonic()
    proc = _train(["+experiment=tiny_cpu", "algo.advantage=nope", "data.source=/nonexistent", f"run_dir={run_dir}"],
                  cwd=tmp_path)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 2
    lines = [x for x in proc.stderr.splitlines() if x.startswith("config error: ")]
    assert any(x.startswith("config error: algo.advantage: ") for x in lines)
    assert any(x.startswith("config error: data.source: ") for x in lines)
    assert "Traceback" not in proc.stderr and not run_dir.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("overrides,key", [
    (["rollout.temperature=0"], "rollout.temperature"),  # every step would be NaN and skipped, forever
    (["rollout.top_p=0.9"], "rollout.top_p"),  # log-probs of the untruncated distribution
    (["algo.tis_cap=2"], "algo.tis_cap"),  # weights always 1
    (["algo.loss=nope"], "algo.loss"),
    (["model.options.param_dtype=bfloat16", "optim.lr=1e-6"], "model.options.param_dtype"),
    (["agent.scaffold=nope"], "agent.scaffold"),
    (["data.source=builtin:nope"], "data.source"),
    (["reward.unfinished=zer0"], "reward.unfinished"),
    (["trainer.max_consecutive_failed_groups=0"], "trainer.max_consecutive_failed_groups"),
    (["algo.mask_turns=broken"], "algo.mask_turns"),
    (["algo.negative_weight=2"], "algo.negative_weight"),
    (["rollout.jax.matmul_dtype=fp8"], "rollout.jax.matmul_dtype"),
], ids=lambda x: str(x))
def test_each_trap_is_refused_naming_its_key(overrides, key, tmp_path):
    proc = _train(["+experiment=tiny_cpu", *overrides, f"run_dir={tmp_path / 'never'}"])
    assert proc.returncode == 2 and f"config error: {key}: " in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_judge_chain_with_no_key_is_refused_when_it_would_silently_drop_the_judge(tmp_path):
    env_free = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    args = ["+experiment=tiny_cpu", "reward=tbrl", "reward.judge.endpoints=[{name: a, base_url: 'http://x/v1', "
            "model: m, api_key_env: NOPE_API_KEY}]", f"run_dir={tmp_path / 'never'}"]
    proc = subprocess.run([sys.executable, "-m", "jaxrl_term.train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**env_free, "XLA_FLAGS": ""})
    assert proc.returncode == 2 and "reward.judge.endpoints" in proc.stderr and "tests-only" in proc.stderr


def test_preflight_flag_checks_and_builds_nothing(tmp_path):
    proc = _train(["+experiment=tiny_cpu", "--preflight", f"run_dir={tmp_path / 'never'}"])
    assert proc.returncode == 0 and "preflight: ok" in proc.stdout and not (tmp_path / "never").exists()


@pytest.mark.parametrize("argv", [
    ["-m", "jaxrl_term.tasks", "ls", "builtin:foo"],
    ["-m", "jaxrl_term.serve", "--model-dir", "/nonexistent"],
    ["-m", "jaxrl_term.reward.judge_eval", "--judges", "/nonexistent.yaml"],
    ["-m", "jaxrl_term.plan", "+experiment=tiny_cpu", "algo.loss=nope"],
], ids=["tasks", "serve", "judge_eval", "plan"])
def test_every_cli_ends_bad_input_with_one_line_and_exit_2(argv):
    proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert len([x for x in proc.stderr.splitlines() if x.strip()]) == 1, proc.stderr


# --------------------------------------------------------------------------- 2. the KL reference


def test_kl_reference_is_the_warm_started_policy_also_after_resume(tmp_path):
    """With KL and a warm start, KL at the first update is 0 (the reference is the warm-started policy, not the
    random init), and after a resume it stays near 0 rather than jumping to the distance from the init."""
    run = tmp_path / "run"
    common = ["+experiment=tiny_cpu", "sandbox.backend=local", "data.families=[create_file]", "data.n_per_cell=1",
              "trainer.warm_start.steps=20", "trainer.warm_start.batch_size=2", "agent.max_turns=2",
              "algo.kl_coef=0.5", "trainer.groups_per_step=1", "algo.group_size=2", "trainer.drop_zero_variance=false",
              "trainer.checkpoint_every=1", "logging.tensorboard=false", "logging.console=false",
              f"cache_dir={tmp_path / 'cache'}", f"run_dir={run}"]
    first = _train([*common, "trainer.steps=1"], timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train([*common, "trainer.steps=2"], timeout=600)
    assert second.returncode == 0, second.stderr[-3000:]
    ms = {m["step"]: m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/kl" in m}
    assert ms[0]["train/kl"] < 1e-6  # policy == reference at the first update
    assert ms[1]["train/kl"] < 0.05  # after resume: still the warm-started reference


# --------------------------------------------------------------------------- 3. staleness tags


def _engine_and_params(prefill_chunk=512):
    from flax import nnx

    from jaxrl_term.model.qwen3 import create_model
    from jaxrl_term.rollout.jax_engine import JaxEngine, JaxEngineConfig

    model = create_model(CFG, seed=1)
    new = jax.tree.map(lambda x: x * 1.5, nnx.to_pure_dict(nnx.state(create_model(CFG, seed=2), nnx.Param)))
    cfg = JaxEngineConfig(max_batch=4, max_seq_len=512, prefill_chunk=prefill_chunk)
    return JaxEngine(model, config=cfg, weight_version=0), new


def test_a_turn_spanning_an_in_place_update_is_tagged_with_the_older_version():
    import asyncio

    from jaxrl_term.rollout.engine import SamplingParams

    eng, new = _engine_and_params()

    async def main():
        task = asyncio.create_task(eng.generate([1, 2, 3], SamplingParams(max_new_tokens=300, seed=3)))
        while eng.stats["generated"] < 20:
            await asyncio.sleep(0.001)
        eng.pause("in_place")  # SGLang's in-place pause: the request stays, and continues on the new weights
        await eng.update_weights(new, 1)
        eng.resume()
        gen = await task
        after = await eng.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=3))
        return gen, after

    try:
        gen, after = asyncio.run(main())
    finally:
        eng.close()
    assert len(gen.output_ids) == 300 and eng.weight_version == 1
    assert gen.weight_version == 0  # it used version 0 for its first tokens: the group must count it as 0
    assert after.weight_version == 1


def test_weights_never_change_in_the_middle_of_a_request_without_a_pause():
    """update_weights from the event loop waits for the engine thread to swap between its own steps, once the
    running request is done: the request is generated entirely by the old weights, bit for bit."""
    import asyncio

    from jaxrl_term.rollout.engine import SamplingParams

    eng, new = _engine_and_params()
    sp = SamplingParams(max_new_tokens=120, seed=5)

    async def main():
        ref = await eng.generate([4, 5, 6], sp)
        task = asyncio.create_task(eng.generate([4, 5, 6], sp))
        while eng.stats["generated"] < ref.prompt_tokens + 125:  # inside the second request
            await asyncio.sleep(0.001)
        await eng.update_weights(new, 1)  # returns once swapped: after the running request finished
        gen = await task
        return ref, gen

    try:
        ref, gen = asyncio.run(main())
    finally:
        eng.close()
    assert gen.output_ids == ref.output_ids and gen.output_logprobs == ref.output_logprobs
    assert gen.weight_version == 0 and eng.weight_version == 1


def test_an_update_during_a_long_prefill_does_not_mix_policies():
    """The old engine swapped weights from the event loop whenever no slot was busy, and a request being
    prefilled holds no slot yet: the swap landed between two prefill chunks."""
    import asyncio

    from jaxrl_term.rollout.engine import SamplingParams

    eng, new = _engine_and_params(prefill_chunk=16)
    prompt = [int(x) for x in np.random.RandomState(0).randint(0, CFG.vocab_size, 400)]
    sp = SamplingParams(max_new_tokens=8, seed=9)

    async def main():
        ref = await eng.generate(prompt, sp)
        eng.slot_cache = [[] for _ in eng.slot_cache]  # no prefix reuse: the second request prefills again
        task = asyncio.create_task(eng.generate(prompt, sp))
        await asyncio.sleep(0.02)  # inside the 25-chunk prefill
        await eng.update_weights(new, 1)
        return ref, await task

    try:
        ref, gen = asyncio.run(main())
    finally:
        eng.close()
    assert gen.output_ids == ref.output_ids and gen.weight_version == 0


def test_untagged_trajectories_make_their_group_an_error_not_the_current_version():
    """The group's version is the oldest any turn used; a turn without a version is an error (the old code fell
    back to the trainer's *current* version, which let stale groups through)."""
    from jaxrl_term.agent.trajectory import Trajectory, TurnRecord
    from jaxrl_term.rollout.pipeline import group_version

    def traj(*versions):
        t = Trajectory.__new__(Trajectory)
        t.turns = []
        for v in versions:
            r = TurnRecord.__new__(TurnRecord)
            r.weight_version = v
            t.turns.append(r)
        return t

    assert group_version([traj(5, 6), traj(7)]) == 5
    assert group_version([traj(5, 6), traj(7, None)]) is None
    assert group_version([traj(), traj(3)]) == 3  # an episode with no model turn at all says nothing
