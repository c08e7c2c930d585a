"""``qwen_tools``: Qwen3's native ``<tool_call>{json}</tool_call>`` calls with the Terminal-Bench-RL tools,
answered with ``tool`` messages (the chat template renders them as ``<tool_response>`` blocks in a user turn).

Several calls per reply run in order; each malformed or invalid call gets an error message after the results.
"""

from __future__ import annotations

import json
import re

from jaxrl_term.agent.scaffold import Action, Parsed, Scaffold
from jaxrl_term.agent.text import head_tail, split_thinking
from jaxrl_term.agent.tmax import native_assistant_message
from jaxrl_term.agent.tools import TOOL_SCHEMAS, ToolError, ToolResult, validate

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
EXAMPLE = '<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>'


class QwenToolsScaffold(Scaffold):
    name = "qwen_tools"
    tools = TOOL_SCHEMAS

    def initial_messages(self, instruction: str) -> list[dict]:
        prompt = self.system_prompt("qwen_tools", instruction=instruction, timeout=int(self.command_timeout_s))
        return [{"role": "system", "content": prompt}, {"role": "user", "content": "Begin working on the task."}]

    def parse(self, text: str) -> Parsed:
        body = split_thinking(text)[1]
        actions, errors, calls = [], [], []
        for raw in _TOOL_CALL.findall(body):
            try:
                call = json.loads(raw)
                if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                    errors.append(f'a tool call must be {{"name": <tool>, "arguments": {{...}}}}; write {EXAMPLE}')
                    continue
                args = call.get("arguments", {})
                if isinstance(args, str):
                    args = json.loads(args)
            except (ValueError, RecursionError) as e:
                errors.append(f"invalid tool call (not JSON: {str(e)[:200]}); write {EXAMPLE}")
                continue
            calls.append({"name": call["name"], "arguments": args})
            try:
                actions.append(Action(call["name"], validate(call["name"], args), raw))
            except ToolError as e:
                errors.append(f"invalid `{call['name']:.60}` call: {e}")
        if body.count("<tool_call>") > body.count("</tool_call>"):
            errors.append("a <tool_call> is never closed with </tool_call>")
        if not actions and not errors:
            errors.append(f"No tool call found; act by calling a tool, e.g. {EXAMPLE}")
        if len(actions) > self.max_actions_per_turn:
            errors.append(f"Only the first {self.max_actions_per_turn} tool calls of a reply are executed.")
            actions = actions[: self.max_actions_per_turn]
        return Parsed(actions, errors, meta={"calls": calls})

    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        msgs = [{"role": "tool", "content": head_tail(r.text, self.max_observation_chars)} for r in results]
        msgs += [{"role": "tool", "content": f"[ERROR] {e}"} for e in parsed.errors]
        return msgs

    def assistant_message(self, text: str, parsed: Parsed) -> dict:
        return native_assistant_message(text, parsed.meta.get("calls") or [])
