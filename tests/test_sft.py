"""``python -m jaxrl_term.sft``: fine-tuning on demonstrations (a teacher's JSONL, a run's successful episodes),
loss on the policy's tokens only, writing an HF dir that train and eval load."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from conftest import REPO, run_stacked
from jaxrl_term.agent.transcript import append_jsonl
from jaxrl_term.sft import episodes_from

ENV = {**os.environ, "XLA_FLAGS": ""}


def test_sft_from_a_teacher_jsonl_writes_a_policy_that_learned_the_demonstration(tmp_path):
    rng = np.random.default_rng(0)
    prompt, reply = rng.integers(10, 900, 40).tolist(), rng.integers(10, 900, 12).tolist()
    rec = {"token_ids": prompt + reply, "loss_mask": [0] * 40 + [1] * 12}
    append_jsonl(tmp_path / "teacher.jsonl", [rec] * 4 + [{"token_ids": [1, 2], "loss_mask": [0, 0]}])
    assert len(episodes_from(str(tmp_path / "teacher.jsonl"))) == 4  # no policy token: not a demonstration
    out = tmp_path / "run"
    r = run_stacked([sys.executable, "-m", "jaxrl_term.sft", f"sft.source={tmp_path / 'teacher.jsonl'}",
                     "sft.steps=30", "sft.lr=3e-3", "sft.batch_size=2", "sft.schedule=warmup_cosine",
                     "sft.warmup_steps=3", "trainer.buckets=[64]", f"run_dir={out}"],
                    cwd=REPO, timeout=600, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((out / "summary.json").read_text())
    assert info["demonstrations"] == 4 and info["schedule"] == "warmup_cosine"
    assert info["loss_last"] < 0.5 * info["loss_first"]
    from jaxrl_term.model.hf import load_pretrained

    model = load_pretrained(out / "hf_final")  # what train (model.path) and eval (policy.path) load
    logits = model(np.asarray([rec["token_ids"]], np.int32))
    greedy = np.asarray(logits[0, 39:51].argmax(-1)).tolist()
    assert sum(a == b for a, b in zip(greedy, reply)) >= 10  # it reproduces the demonstrated reply
    bad = subprocess.run([sys.executable, "-m", "jaxrl_term.sft", f"sft.source={tmp_path / 'none'}",
                          "sft.schedule=linear", f"run_dir={tmp_path / 'bad'}"], cwd=REPO, capture_output=True,
                         text=True, env=ENV)
    assert bad.returncode == 2 and "config error: sft.source" in bad.stderr and "sft.schedule" in bad.stderr


def test_sft_takes_only_the_successful_episodes_of_a_run(tmp_path):
    ev = tmp_path / "ev"
    append_jsonl(ev / "attempts.jsonl", [{"id": "a/attempt-0", "reward": 1.0}, {"id": "b/attempt-0", "reward": 0.0}])
    append_jsonl(ev / "tokens.jsonl", [{"id": "a/attempt-0", "token_ids": [5, 6, 7], "loss_mask": [0, 1, 1]},
                                       {"id": "b/attempt-0", "token_ids": [8, 9], "loss_mask": [0, 1]}])
    assert [d.token_ids for d in episodes_from(str(ev))] == [[5, 6, 7]]
    tr = tmp_path / "tr"
    append_jsonl(tr / "trajectories" / "step_000000.jsonl", [{"id": "x", "reward": 0.5}, {"id": "y", "reward": 1.0}])
    append_jsonl(tr / "trajectories" / "step_000000.tokens.jsonl",
                 [{"id": "x", "token_ids": [1, 2], "loss_mask": [0, 1]}, {"id": "y", "token_ids": [3, 4],
                                                                           "loss_mask": [0, 1]}])
    assert [d.token_ids for d in episodes_from(str(tr))] == [[3, 4]]
    assert [d.token_ids for d in episodes_from(str(tr), min_reward=0.5)] == [[1, 2], [3, 4]]
