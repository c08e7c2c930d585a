"""What every scaffold (action format) provides: the first messages, a parser, the observation messages.

A parser never raises: every reply becomes actions and/or parse errors (``Parsed``), and the loop scores the
rest. Arguments are checked by the tools' ``validate``; the strings in them are made encodable first.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib.resources
import string
from pathlib import Path
from typing import Any

from jaxrl_term.agent.tools import ToolResult


@dataclasses.dataclass
class Action:
    tool: str
    args: dict[str, Any]
    raw: str = ""


@dataclasses.dataclass
class Parsed:
    actions: list[Action]
    errors: list[str]
    no_action: bool = False  # the reply attempted no action at all: the scaffold ends the episode on it
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)  # scaffold-specific (e.g. the reply role)

    @property
    def is_error_turn(self) -> bool:
        """Nothing valid to execute and something malformed: counts toward the consecutive parse-error limit."""
        return not self.actions and bool(self.errors)


# An observation message may give its content as parts: (text, cuttable) pairs whose texts, joined, are the
# content. The loop's token budget cuts only the cuttable ones (the results), so a scaffold's wrappers and
# exit codes survive; a message without parts is cut as a whole.
PARTS = "parts"


def from_parts(role: str, parts: list[tuple[str, bool]]) -> dict:
    """A chat message whose content is ``parts`` joined, the parts kept for the token budget."""
    return {"role": role, "content": "".join(t for t, _ in parts), PARTS: parts}


def load_prompt(name: str, **values: Any) -> str:
    text = importlib.resources.files("jaxrl_term.agent").joinpath(f"prompts/{name}.md").read_text()
    return string.Template(text).safe_substitute(**values)


class Scaffold(abc.ABC):
    name = "base"
    tools: list | None = None  # passed to the chat template (native tool calling)

    def __init__(self, *, max_actions_per_turn: int = 10, max_observation_chars: int = 16000,
                 command_timeout_s: float = 30.0, prompt: str | None = None):
        self.max_actions_per_turn = max_actions_per_turn
        self.max_observation_chars = max_observation_chars
        self.command_timeout_s = command_timeout_s
        self.prompt = None
        if prompt:  # agent.prompt: a file replacing the built-in system prompt
            path = Path(prompt).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"agent.prompt={prompt}: no such file; give a system prompt template "
                                        f"(see jaxrl_term/agent/prompts/{self.name}.md for its $variables)")
            self.prompt = path.read_text()

    def system_prompt(self, name: str, **values: Any) -> str:
        """The built-in prompt ``name`` or agent.prompt's file, with ``$values`` filled in."""
        if self.prompt is None:
            return load_prompt(name, **values)
        return string.Template(self.prompt).safe_substitute(**values)

    @abc.abstractmethod
    def initial_messages(self, instruction: str) -> list[dict]:
        """The conversation before the first reply."""

    @abc.abstractmethod
    def parse(self, text: str) -> Parsed:
        """Model output text -> actions and parse errors (never raises)."""

    def finished(self, parsed: Parsed, results: list[ToolResult]) -> bool:
        """Whether this turn ends the episode as the agent's own decision."""
        return any(r.finished for r in results)

    @abc.abstractmethod
    def observation_messages(self, parsed: Parsed, results: list[ToolResult]) -> list[dict]:
        """Chat messages that carry the results (and parse errors) back to the model; a message may mark its
        results as the parts the token budget may cut (:func:`from_parts`)."""

    def assistant_message(self, text: str, parsed: Parsed) -> dict:
        """The assistant turn as a chat message (for re-rendering and judging)."""
        return {"role": "assistant", "content": text}
