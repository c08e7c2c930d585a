"""Action formats (scaffolds): what the model writes, how it is parsed, how results come back.

- ``tbrl``: Terminal-Bench-RL's XML elements wrapping YAML, several per reply (:mod:`jaxrl_term.agent.tbrl`).
- ``tmax``: Tmax's single native ``bash`` tool call per reply, tool messages ending ``(exit_code=N)``, the
  ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` submit marker (:mod:`jaxrl_term.agent.tmax`).
- ``bash``: one fenced bash block per reply with a completion sentinel (:mod:`jaxrl_term.agent.bash`).
- ``qwen_tools``: Qwen3's native tool calls with the TB-RL tools (:mod:`jaxrl_term.agent.qwen_tools`).

Parsers never raise: every model output yields valid actions and/or parse errors.
"""

from __future__ import annotations

from typing import Any

from jaxrl_term.agent.bash import SENTINEL, BashScaffold
from jaxrl_term.agent.qwen_tools import QwenToolsScaffold
from jaxrl_term.agent.scaffold import Action, Parsed, Scaffold, load_prompt
from jaxrl_term.agent.tbrl import TbrlScaffold
from jaxrl_term.agent.text import split_thinking
from jaxrl_term.agent.tmax import SUBMIT_MARKER, TmaxScaffold

__all__ = ["SENTINEL", "SUBMIT_MARKER", "Action", "BashScaffold", "Parsed", "QwenToolsScaffold", "SCAFFOLDS",
           "Scaffold", "TbrlScaffold", "TmaxScaffold", "load_prompt", "make_scaffold", "split_thinking"]

SCAFFOLDS: dict[str, type[Scaffold]] = {"tbrl": TbrlScaffold, "tmax": TmaxScaffold, "bash": BashScaffold,
                                        "qwen_tools": QwenToolsScaffold}


def make_scaffold(name: str, **kwargs: Any) -> Scaffold:
    if name not in SCAFFOLDS:
        raise ValueError(f"agent.scaffold={name!r}; use one of {sorted(SCAFFOLDS)}")
    return SCAFFOLDS[name](**kwargs)
