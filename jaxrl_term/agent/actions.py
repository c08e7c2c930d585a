"""Action formats (scaffolds): what the model writes, how it is parsed, how results come back.

- ``tbrl``: XML elements wrapping YAML bodies, several per reply, executed in order (Terminal-Bench-RL);
  anything inside ``<think>`` is ignored on purpose (the prompt says so); malformed actions give a
  ``<parse_error>`` with the expected format.
- ``bash``: one bash code block per reply (Tmax / mini-SWE-agent style); the episode ends when a command
  prints the completion sentinel; format errors get a corrective message and the episode goes on.
- ``qwen_tools``: Qwen3's native ``<tool_call>{json}</tool_call>`` calls answered with ``tool`` messages
  (the chat template renders them as ``<tool_response>``), with the same tools as ``tbrl``.

Parsers never raise: every model output yields valid actions and/or parse errors.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.resources
import json
import re
import string
from typing import Any

import yaml

from jaxrl_term.agent.tools import TOOL_NAMES, TOOL_SCHEMAS, ToolResult

SENTINEL = "JAXRL_TERM_TASK_COMPLETE"
MAX_BODY_CHARS = 200_000


@dataclasses.dataclass
class Action:
    tool: str
    args: dict[str, Any]
    raw: str = ""


@dataclasses.dataclass
class Parsed:
    actions: list[Action]
    errors: list[str]

    @property
    def is_error_turn(self) -> bool:
        """Nothing valid to execute: counts toward the consecutive parse-error limit."""
        return not self.actions


def strip_thinking(text: str) -> str:
    """Drop ``<think>...</think>`` blocks, and an unclosed ``<think>`` to the end (still thinking)."""
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.S)
    at = text.find("<think>")
    return text if at < 0 else text[:at]


def truncate(text: str, limit: int) -> str:
    """Head + tail with a marker, on characters."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return text[:head] + f"\n[... {len(text) - limit} characters truncated ...]\n" + text[-(limit - head):]


class _NoAliasLoader(yaml.SafeLoader):
    """YAML without anchors/aliases: a model's output cannot expand into a 'billion laughs'."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("YAML aliases (*name) are not allowed")
        return super().compose_node(parent, index)


def load_prompt(name: str, **values: Any) -> str:
    text = importlib.resources.files("jaxrl_term.agent").joinpath(f"prompts/{name}.md").read_text()
    return string.Template(text).safe_substitute(**values)


class Scaffold(abc.ABC):
    name = "base"
    tools: list | None = None  # passed to the chat template (native tool calling)
    stop: tuple[str, ...] = ()

    def __init__(self, *, max_actions_per_turn: int = 10, max_observation_chars: int = 16000,
                 command_timeout_s: float = 30.0):
        self.max_actions_per_turn = max_actions_per_turn
        self.max_observation_chars = max_observation_chars
        self.command_timeout_s = command_timeout_s

    def system_prompt(self, instruction: str) -> str:
        return load_prompt(self.name, instruction=instruction, sentinel=SENTINEL,
                           timeout=int(self.command_timeout_s))

    def initial_messages(self, instruction: str) -> list[dict]:
        """Instruction inside the system prompt's template; the user turn asks to begin."""
        return [{"role": "system", "content": self.system_prompt(instruction)},
                {"role": "user", "content": "Begin working on the task."}]

    @abc.abstractmethod
    def parse(self, text: str) -> Parsed:
        """Model output text -> actions and parse errors (never raises)."""

    def finished(self, results: list[ToolResult]) -> bool:
        return any(r.finished for r in results)

    @abc.abstractmethod
    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        """Chat messages that carry the results (and parse errors) back to the model."""

    def assistant_message(self, text: str, parsed: Parsed) -> dict:
        """The assistant turn as a chat message (for re-rendering and judging)."""
        return {"role": "assistant", "content": text}


# -------------------------------------------------------------------------------------------------- tbrl

TBRL_FORMAT = ("Write each action as an XML element named after its tool with a YAML mapping inside, e.g.\n"
               "<bash>\ncmd: ls -la\n</bash>\nTools: " + ", ".join(TOOL_NAMES) + ".")
_TBRL_OPEN = re.compile(r"<(" + "|".join(TOOL_NAMES) + r")>")


class TbrlScaffold(Scaffold):
    name = "tbrl"

    def parse(self, text: str) -> Parsed:
        body_text = strip_thinking(text)
        actions: list[Action] = []
        errors: list[str] = []
        pos = 0
        while True:
            m = _TBRL_OPEN.search(body_text, pos)
            if m is None:
                break
            tool = m.group(1)
            close = body_text.find(f"</{tool}>", m.end())
            if close < 0:
                errors.append(f"<{tool}> is never closed with </{tool}>.")
                break
            raw = body_text[m.start(): close + len(tool) + 3]
            body = body_text[m.end(): close]
            pos = close + len(tool) + 3
            if len(body) > MAX_BODY_CHARS:
                errors.append(f"<{tool}>: the action body is longer than {MAX_BODY_CHARS} characters.")
                continue
            try:
                args = yaml.load(body, Loader=_NoAliasLoader) if body.strip() else {}
            except yaml.YAMLError as e:
                first = str(e).splitlines()[0] if str(e) else type(e).__name__
                errors.append(f"<{tool}>: invalid YAML ({first}). Use block scalars (|) for multi-line text "
                              "and quote values containing ': '.")
                continue
            if args is None:
                args = {}
            if not isinstance(args, dict) or not all(isinstance(k, str) for k in args):
                errors.append(f"<{tool}>: the body must be a YAML mapping of argument: value.")
                continue
            actions.append(Action(tool, args, raw))
        if not actions and not errors:
            errors.append("No action found in your reply.")
        if len(actions) > self.max_actions_per_turn:
            errors.append(f"Only the first {self.max_actions_per_turn} actions of a reply are executed.")
            actions = actions[: self.max_actions_per_turn]
        return Parsed(actions, errors)

    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        parts = []
        for r in results:
            status = "" if r.ok else "[error]\n"
            parts.append(f"<{r.tool}_output>\n{status}{truncate(r.text, self.max_observation_chars)}\n</{r.tool}_output>")
        for e in parsed.errors:
            parts.append(f"<parse_error>\n{e}\n{TBRL_FORMAT}\n</parse_error>")
        return [{"role": "user", "content": "\n".join(parts)}]


# -------------------------------------------------------------------------------------------------- bash

_BASH_BLOCK = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)```", re.S)


class BashScaffold(Scaffold):
    name = "bash"

    def parse(self, text: str) -> Parsed:
        blocks = _BASH_BLOCK.findall(strip_thinking(text))
        if len(blocks) != 1:
            found = "no" if not blocks else f"{len(blocks)}"
            return Parsed([], [f"Your reply had {found} bash code blocks; it must have EXACTLY ONE:\n"
                               "your reasoning, then\n```bash\n<one command>\n```"])
        cmd = blocks[0].strip()
        if not cmd:
            return Parsed([], ["The bash code block is empty."])
        return Parsed([Action("bash", {"cmd": cmd}, blocks[0])], [])

    def finished(self, results: list[ToolResult]) -> bool:
        return any(r.tool == "bash" and r.text.lstrip().startswith(SENTINEL) for r in results)

    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        if parsed.errors or not results:
            return [{"role": "user", "content": "Format error: " + ("\n".join(parsed.errors) or "no command ran")}]
        r = results[0]
        note = "\n<note>the command timed out and was interrupted</note>" if r.timed_out else ""
        return [{"role": "user", "content": f"<returncode>{r.exit_code}</returncode>{note}\n<output>\n"
                 f"{truncate(r.text, self.max_observation_chars)}</output>"}]


# -------------------------------------------------------------------------------------------- qwen_tools

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


class QwenToolsScaffold(Scaffold):
    name = "qwen_tools"
    tools = TOOL_SCHEMAS

    def parse(self, text: str) -> Parsed:
        body = strip_thinking(text)
        actions, errors = [], []
        for raw in _TOOL_CALL.findall(body):
            try:
                call = json.loads(raw)
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    raise ValueError('expected {"name": <tool>, "arguments": {...}}')
                args = call.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
                if not isinstance(args, dict):
                    raise ValueError("arguments must be a JSON object")
                actions.append(Action(call["name"], args, raw))
            except (ValueError, RecursionError) as e:
                errors.append(f"invalid tool call ({str(e)[:200]}); write "
                              '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>')
        if "<tool_call>" in body and body.count("<tool_call>") > body.count("</tool_call>"):
            errors.append("a <tool_call> is never closed with </tool_call>")
        if not actions and not errors:
            errors.append("No tool call found; act by calling a tool.")
        if len(actions) > self.max_actions_per_turn:
            errors.append(f"Only the first {self.max_actions_per_turn} tool calls of a reply are executed.")
            actions = actions[: self.max_actions_per_turn]
        return Parsed(actions, errors)

    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        msgs = [{"role": "tool", "content": ("" if r.ok else "error: ") + truncate(r.text, self.max_observation_chars)}
                for r in results]
        msgs += [{"role": "tool", "content": "error: " + e} for e in parsed.errors]
        return msgs

    def assistant_message(self, text: str, parsed: Parsed) -> dict:
        content = _TOOL_CALL.sub("", text).rstrip("\n")
        calls = [{"type": "function", "function": {"name": a.tool, "arguments": a.args}} for a in parsed.actions]
        return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


SCAFFOLDS: dict[str, type[Scaffold]] = {"tbrl": TbrlScaffold, "bash": BashScaffold, "qwen_tools": QwenToolsScaffold}


def make_scaffold(name: str, **kwargs: Any) -> Scaffold:
    if name not in SCAFFOLDS:
        raise ValueError(f"agent.scaffold={name!r}; use one of {sorted(SCAFFOLDS)}")
    return SCAFFOLDS[name](**kwargs)
