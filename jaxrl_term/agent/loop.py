"""The episode: token in, token out.

The prompt is rendered once by the chat template. Each turn sends the exact ids so far to the engine and
appends its output ids verbatim (loss mask 1, their log-probs kept); the observation is appended as the chat
template's delta for the new turn(s) plus the generation prompt (loss mask 0). The policy's own tokens are
never decoded and re-encoded into the stream. No JAX here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid

from jaxrl_term.agent.actions import Parsed, Scaffold
from jaxrl_term.agent.tools import ToolBox
from jaxrl_term.agent.trajectory import Trajectory, TurnRecord
from jaxrl_term.rollout.engine import EngineError, RolloutEngine, SamplingParams
from jaxrl_term.sandbox.base import Sandbox

log = logging.getLogger(__name__)
EOS_TEXT = "<|im_end|>"


@dataclasses.dataclass(frozen=True)
class AgentLimits:
    max_turns: int = 30
    max_tokens_per_turn: int = 2048
    max_context_tokens: int = 32768
    command_timeout_s: float = 30.0
    trajectory_timeout_s: float = 1800.0  # wall clock for the whole episode (also capped by the task's own)
    max_parse_error_turns: int = 3
    min_new_tokens: int = 16  # less room than this in the context ends the episode (context_full)


class ChatDelta:
    """Token ids of new chat turns appended after an assistant turn, as the chat template renders them."""

    def __init__(self, tokenizer, tools=None, enable_thinking: bool | None = None):
        self.tok, self.tools = tokenizer, tools
        self.kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        probe = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], False)
        self.after_eos = probe[probe.rindex(EOS_TEXT) + len(EOS_TEXT):]  # "\n" for Qwen3
        self._base = self._render([{"role": "user", "content": "x"}], False)
        self.eos_ids = [tokenizer.convert_tokens_to_ids(EOS_TEXT)]
        eot = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        if isinstance(eot, int) and eot != tokenizer.unk_token_id:
            self.eos_ids.append(eot)

    def _render(self, messages, gen: bool) -> str:
        return self.tok.apply_chat_template(messages, tools=self.tools, tokenize=False, add_generation_prompt=gen,
                                            **self.kw)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        return self.encode(self._render(messages, True))

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def observation_ids(self, messages: list[dict], closed: bool) -> list[int]:
        """``messages`` (user or tool turns) + the generation prompt. ``closed``: the assistant's output
        already ends with <|im_end|>; otherwise the turn is closed here (those tokens are not the policy's)."""
        full = self._render([{"role": "user", "content": "x"}, *messages], True)
        if not full.startswith(self._base):
            raise ValueError("chat template renders history differently when turns are added; cannot append deltas")
        return self.encode(("" if closed else EOS_TEXT) + self.after_eos + full[len(self._base):])


async def run_episode(
    task,
    engine: RolloutEngine,
    sandbox: Sandbox,
    tokenizer,
    scaffold: Scaffold,
    *,
    sampling: SamplingParams | None = None,
    limits: AgentLimits | None = None,
    enable_thinking: bool | None = None,
    workdir: str | None = None,
) -> Trajectory:
    """Run one episode of ``task`` in ``sandbox``. Never raises for model, tool or engine failures: the
    trajectory records how it ended (``end_reason``); engine failures make it invalid."""
    limits = limits or AgentLimits()
    sampling = sampling or SamplingParams()
    t_start = time.monotonic()
    deadline = t_start + min(limits.trajectory_timeout_s, getattr(task, "agent_timeout_s", None) or float("inf"))
    delta = ChatDelta(tokenizer, scaffold.tools, enable_thinking)
    stop_ids = tuple(dict.fromkeys((*sampling.stop_token_ids, *delta.eos_ids)))
    tools = ToolBox(sandbox, workdir=workdir or task.environment.workdir, command_timeout_s=limits.command_timeout_s)
    messages = scaffold.initial_messages(task.instruction)
    ids = delta.prompt_ids(messages)
    mask, logprobs = [0] * len(ids), [0.0] * len(ids)
    traj = Trajectory(task.id, scaffold.name, ids, mask, logprobs, len(ids), messages, [], "max_turns")

    def end(reason: str, error: str | None = None) -> Trajectory:
        traj.end_reason, traj.error, traj.duration_s = reason, error, time.monotonic() - t_start
        return traj

    session = f"{task.id}/{uuid.uuid4().hex[:12]}"
    if len(ids) + limits.min_new_tokens > limits.max_context_tokens:
        return end("context_full", f"the prompt alone has {len(ids)} tokens")
    parse_streak = 0
    for turn in range(limits.max_turns):
        room = limits.max_context_tokens - len(ids)
        if room < limits.min_new_tokens:
            return end("context_full")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return end("timeout")
        # a seeded episode gives every turn its own seed (the same seed each turn would repeat its randomness)
        seed = None if sampling.seed is None else (sampling.seed + 1_000_003 * turn) % 2**31
        # room - 1: SGLang rejects input + max_new >= context (<= 0.5.10) with HTTP 400
        params = sampling.replace(max_new_tokens=min(limits.max_tokens_per_turn, room - 1), stop_token_ids=stop_ids,
                                  seed=seed)
        t0 = time.monotonic()
        try:
            gen = await asyncio.wait_for(engine.generate(list(ids), params, session=session), remaining)
        except asyncio.TimeoutError:
            return end("timeout", "the episode's wall-clock limit ran out while the engine was generating")
        except EngineError as e:
            return end("engine_error", str(e))
        except Exception as e:  # noqa: BLE001 - any engine failure invalidates the trajectory, never scores 0
            return end("engine_error", f"{type(e).__name__}: {e}")
        gen_s = time.monotonic() - t0
        if gen.finish_reason == "length" and not gen.output_ids:  # the server's context has no room left
            return end("context_full", "no room left in the server's context")
        if gen.finish_reason == "abort" or not gen.output_ids:
            return end("engine_error", f"the engine aborted the request ({gen.finish_reason})")
        start = len(ids)
        out = list(gen.output_ids)
        ids.extend(out)
        mask.extend([1] * len(out))
        logprobs.extend(float(x) for x in gen.output_logprobs)
        closed = out[-1] in stop_ids
        text = tokenizer.decode(out[:-1] if closed else out, skip_special_tokens=False)
        parsed: Parsed = scaffold.parse(text)
        messages.append(scaffold.assistant_message(text, parsed))
        t1 = time.monotonic()
        results = []
        try:
            for action in parsed.actions:
                res = await tools.call(action.tool, action.args, time_left_s=deadline - time.monotonic())
                results.append(res)
                if res.finished:
                    break
        except Exception as e:  # noqa: BLE001 - the sandbox itself broke (not the model's doing): invalid
            return end("sandbox_error", f"{type(e).__name__}: {e}")
        record = TurnRecord(turn, start, len(out), 0, text, [{"tool": a.tool, "args": a.args} for a in parsed.actions],
                            list(parsed.errors),
                            [{"tool": r.tool, "ok": r.ok, "text": r.text, "exit_code": r.exit_code,
                              "timed_out": r.timed_out, "duration_s": r.duration_s} for r in results],
                            gen.finish_reason, gen_s, time.monotonic() - t1, gen.weight_version)
        traj.turns.append(record)
        if scaffold.finished(results):
            return end("finished")
        parse_streak = parse_streak + 1 if parsed.is_error_turn else 0
        if parse_streak >= limits.max_parse_error_turns:
            return end("parse_errors", f"{parse_streak} replies in a row without a valid action")
        if time.monotonic() >= deadline:
            return end("timeout")
        obs = scaffold.observation_messages(parsed, results)
        obs_ids = delta.observation_ids(obs, closed)
        if len(ids) + len(obs_ids) + limits.min_new_tokens > limits.max_context_tokens:
            return end("context_full")
        ids.extend(obs_ids)
        mask.extend([0] * len(obs_ids))
        logprobs.extend([0.0] * len(obs_ids))
        messages.extend(obs)
        record.n_observation = len(obs_ids)
    return end("max_turns")
