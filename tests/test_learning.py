"""The learning experiment's preset (``+experiment=tiny_learn``, experiments/learning_curve/) end to end at a
toy size: SFT on oracle demonstrations writes a checkpoint, two RL steps start from it, change the policy, log
finite metrics and run the held-out evaluation (an unseen family included). The real experiment is not run here."""

from __future__ import annotations

import json
import math
import os
import sys

import numpy as np
from safetensors.numpy import load_file

from conftest import REPO, run_stacked

ENV = {**os.environ, "XLA_FLAGS": ""}
SMALL = ["sandbox.backend=local", "data.families=[create_file,count_matches]", "data.difficulties=[easy]",
         "data.n_per_cell=2", "logging.tensorboard=false"]


def _run(module, args, timeout=600):
    return run_stacked([sys.executable, "-m", module, "+experiment=tiny_learn", *SMALL, *args], cwd=REPO,
                       timeout=timeout, env=ENV)


def test_two_rl_steps_of_the_learning_preset_from_an_sft_checkpoint(tmp_path):
    sft, run = tmp_path / "sft", tmp_path / "rl"
    r = _run("jaxrl_term.sft", ["sft.steps=100", "sft.lr=3e-3", "sft.batch_size=4", f"run_dir={sft}"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run("jaxrl_term.train", [f"model.path={sft / 'hf_final'}", "trainer.steps=2", "trainer.groups_per_step=2",
                                  "trainer.eval_every=2", "trainer.eval_before_train=false", "trainer.report=false",
                                  "eval.data.families=[create_file,find_files]", "eval.data.difficulties=[easy]",
                                  "eval.data.n_per_cell=1", "rollout.temperature=0.7", f"run_dir={run}"])
    assert r.returncode == 0, r.stderr[-4000:]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in steps] == [0, 1]
    assert sum(m["train/updates"] - m["train/skipped_updates"] for m in steps) > 0, steps  # a learning signal
    for m in steps:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    evals = [m for m in metrics if "eval/pass@1" in m]
    assert [m["step"] for m in evals] == [2] and evals[0]["eval/tasks"] == 2  # find_files: never trained on
    assert json.loads((run / "eval" / "step_000002" / "summary.json").read_text())["tasks"] == 2
    before, after = load_file(sft / "hf_final" / "model.safetensors"), load_file(run / "hf_final" / "model.safetensors")
    assert before.keys() == after.keys()
    assert max(float(np.max(np.abs(before[k] - after[k]))) for k in before) > 0, "RL did not change the policy"
