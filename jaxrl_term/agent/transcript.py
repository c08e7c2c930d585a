"""Transcripts people can read: an episode as its instruction, each reply, action and output, the verifier's
per-test results and the reward parts (docs/run_dir.md), without token ids (those go to a separate file).

Training steps and evaluation attempts write the same shape, so one report reads both. No JAX here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from jaxrl_term.agent.trajectory import Trajectory

PASS_EPS = 1e-9


def passed(score: float | None, outcome: str | None) -> bool:
    """An attempt passes when the verifier scored it and every test passed (weighted score 1)."""
    return outcome == "scored" and score is not None and score >= 1.0 - PASS_EPS


class Verdict:
    """The verifier's verdict as the rollout pipeline keeps it in ``reward_parts`` (tests score, outcome,
    per-test results), shaped like ``VerifierResult`` for :func:`transcript`."""

    def __init__(self, parts: Mapping[str, Any]):
        self.score = parts.get("tests")
        self.outcome = parts.get("outcome")
        self.passed = dict(parts.get("tests_passed") or {})
        self.error = None


def transcript(traj: Trajectory | None, task, *, id: str, result=None, reward: float | None = None,
               reward_parts: Mapping[str, Any] | None = None, **extra: Any) -> dict:
    """The transcript of one episode of ``task`` (``traj`` None: an agent that ran nothing, e.g. nop).
    ``result``: the verifier's ``VerifyResult``; ``extra``: attempt, step, group, policy, advantage, ..."""
    tests = dict(result.passed) if result is not None else {}
    outcome = result.outcome if result is not None else None
    score = result.score if result is not None else None
    out: dict[str, Any] = {
        "id": id, "task": task.id, **extra,
        "scaffold": traj.scaffold if traj is not None else None,
        "instruction": task.instruction,
        "difficulty": task.difficulty, "category": task.category,
        "end_reason": traj.end_reason if traj is not None else extra.get("end_reason"),
        "error": (traj.error if traj is not None else None) or (result.error if result is not None else None),
        "reward": reward if reward is not None else (traj.reward if traj is not None else score),
        "reward_parts": dict(reward_parts if reward_parts is not None else (traj.reward_parts if traj else {})),
        "tests": tests, "verifier_rewards": dict(getattr(result, "rewards", None) or {}),
        "outcome": outcome, "score": score, "pass": passed(score, outcome),
        "tokens": len(traj.token_ids) if traj is not None else 0,
        "policy_tokens": traj.num_policy_tokens if traj is not None else 0,
        "duration_s": traj.duration_s if traj is not None else extra.get("duration_s", 0.0),
        "turns": [turn_dict(t) for t in traj.turns] if traj is not None else [],
    }
    return out


def turn_dict(t) -> dict:
    return {"index": t.index, "reply": t.text, "actions": t.actions, "errors": t.errors, "results": t.results,
            "finish_reason": t.finish_reason, "gen_s": round(t.gen_s, 4), "tool_s": round(t.tool_s, 4),
            "weight_version": t.weight_version}


def tokens_record(id: str, traj: Trajectory) -> dict:
    return {"id": id, "task": traj.task_id, "prompt_len": traj.prompt_len, "token_ids": traj.token_ids,
            "loss_mask": traj.loss_mask, "logprobs": traj.logprobs}


def to_markdown(tr: Mapping[str, Any], max_chars: int = 4000) -> str:
    """A transcript as markdown (TensorBoard / wandb text): instruction, replies, commands, outputs, tests."""

    def cut(text: str) -> str:
        text = str(text)
        return text if len(text) <= max_chars else text[: max_chars // 2] + "\n[...]\n" + text[-max_chars // 2:]

    lines = [f"**{tr.get('task')}** ({tr.get('id')}): reward {tr.get('reward')}, end {tr.get('end_reason')}, "
             f"outcome {tr.get('outcome')}", "", "**Instruction**", "", fence(cut(tr.get("instruction", "")))]
    for t in tr.get("turns", []):
        lines += ["", f"**Turn {t.get('index')}**", "", fence(cut(t.get("reply", "")))]
        for a, r in zip(t.get("actions", []), t.get("results", []) + [None] * len(t.get("actions", []))):
            lines += ["", f"`{a.get('tool')}` " + json.dumps(a.get("args"), ensure_ascii=False)[:500]]
            if r is not None:
                lines += [f"exit {r.get('exit_code')}", fence(cut(r.get("text", "")))]
        for e in t.get("errors", []):
            lines += [f"parse error: {cut(e)}"]
    if tr.get("tests"):
        lines += ["", "**Tests**: " + ", ".join(f"{k} {'pass' if v else 'FAIL'}" for k, v in tr["tests"].items())]
    return "\n".join(lines)


def fence(text: str) -> str:
    ticks = "```"
    while ticks in text:
        ticks += "`"
    return f"{ticks}\n{text}\n{ticks}"


def append_jsonl(path: str | os.PathLike, records: Iterable[Mapping], *, sync: bool = False) -> None:
    """Append records, one JSON line each (no NaN: a non-finite number is written as null)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for r in records:
            f.write(dumps(r) + "\n")
        if sync:
            f.flush()
            os.fsync(f.fileno())


def write_jsonl(path: str | os.PathLike, records: Iterable[Mapping]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w") as f:
        for r in records:
            f.write(dumps(r) + "\n")
    os.replace(tmp, path)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSONL file; a line that does not parse (a write cut by a kill) is skipped."""
    out = []
    try:
        with open(path) as f:
            for line in f:
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue
    except FileNotFoundError:
        pass
    return out


def dumps(record: Mapping) -> str:
    return json.dumps(_finite(record), ensure_ascii=False, default=str, allow_nan=False)


def _finite(x):
    if isinstance(x, float):
        return x if x == x and abs(x) != float("inf") else None
    if isinstance(x, Mapping):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    if hasattr(x, "item") and getattr(x, "shape", None) == ():  # numpy scalars
        return _finite(x.item())
    return x
