"""A trajectory: the exact token stream the policy saw and produced, with everything needed to train on it
and to audit it. No JAX here."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

END_REASONS = ("finished", "max_turns", "context_full", "timeout", "parse_errors", "engine_error", "sandbox_error")
INVALID_ENDS = ("engine_error", "sandbox_error")  # retry or drop; never a 0 reward


@dataclasses.dataclass
class TurnRecord:
    index: int
    start: int  # position in token_ids of the turn's first engine token
    n_output: int  # engine tokens (loss mask 1)
    n_observation: int  # observation delta tokens appended after them (loss mask 0)
    text: str  # the engine output, decoded
    actions: list[dict]  # {"tool", "args"}
    errors: list[str]  # parse errors
    results: list[dict]  # {"tool", "ok", "text", "exit_code", "timed_out", "duration_s"}
    finish_reason: str
    gen_s: float
    tool_s: float
    weight_version: int | None = None


@dataclasses.dataclass
class Trajectory:
    task_id: str
    scaffold: str
    token_ids: list[int]
    loss_mask: list[int]  # 1 exactly on engine-produced tokens
    logprobs: list[float]  # the engine's fp32 log-prob on masked tokens, 0 elsewhere
    prompt_len: int
    messages: list[dict]  # the conversation as chat messages (for the drift check and the judge)
    turns: list[TurnRecord]
    end_reason: str
    error: str | None = None
    duration_s: float = 0.0
    reward: float | None = None
    reward_parts: dict[str, Any] = dataclasses.field(default_factory=dict)
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return self.end_reason not in INVALID_ENDS

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def weight_versions(self) -> list[int]:
        return sorted({t.weight_version for t in self.turns if t.weight_version is not None})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Trajectory:
        d = dict(d)
        d["turns"] = [TurnRecord(**t) for t in d.get("turns", [])]
        return cls(**d)

    def check(self) -> None:
        """Internal consistency: equal lengths, mask and log-probs where the turns say."""
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == n):
            raise ValueError(f"trajectory {self.task_id}: ids {n}, mask {len(self.loss_mask)}, "
                             f"logprobs {len(self.logprobs)}")
        expect = [0] * n
        for t in self.turns:
            for i in range(t.start, t.start + t.n_output):
                expect[i] = 1
        if expect != list(self.loss_mask):
            raise ValueError(f"trajectory {self.task_id}: loss mask does not match the engine's turns")


def write_jsonl(path: str | os.PathLike, trajectories: Iterable[Trajectory], append: bool = True) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a" if append else "w") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_dict(), ensure_ascii=False) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[Trajectory]:
    with open(path) as f:
        return [Trajectory.from_dict(json.loads(line)) for line in f if line.strip()]


@dataclasses.dataclass(frozen=True)
class DriftReport:
    equal: bool
    first_diff: int | None  # first token index where the stream and a fresh rendering differ
    stream_len: int
    render_len: int
    stream_context: str = ""
    render_context: str = ""


def check_drift(traj: Trajectory, tokenizer, *, tools=None, enable_thinking: bool | None = None) -> DriftReport:
    """Re-render ``traj.messages`` with the chat template and compare with the token stream.

    Differences are expected where the template rewrites history (Qwen3 drops the reasoning of assistant
    turns before the last user query) and wherever re-tokenising text differs from what was sampled; the
    report says where the first one is.
    """
    kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    gen_prompt = traj.messages[-1]["role"] != "assistant"
    text = tokenizer.apply_chat_template(traj.messages, tools=tools, tokenize=False,
                                         add_generation_prompt=gen_prompt, **kw)
    rendered = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = list(traj.token_ids)
    if not gen_prompt and rendered[len(stream):] and tokenizer.decode(rendered[len(stream):]).strip() == "":
        rendered = rendered[: len(stream)]  # the template's newline after the final <|im_end|>
    first = next((i for i, (a, b) in enumerate(zip(stream, rendered)) if a != b), None)
    if first is None and len(stream) != len(rendered):
        first = min(len(stream), len(rendered))
    if first is None:
        return DriftReport(True, None, len(stream), len(rendered))
    lo = max(0, first - 8)
    return DriftReport(False, first, len(stream), len(rendered), tokenizer.decode(stream[lo: first + 24]),
                       tokenizer.decode(rendered[lo: first + 24]))
