"""Text hygiene between the model, the tools and the tokenizer.

What a model writes can be any Unicode text, and JSON or YAML escapes can turn it into strings Python holds but
cannot encode: a lone surrogate (``"\\ud800"``) makes UTF-8 encoders and the tokenizer raise. Such strings are
made encodable here (U+FFFD in place of each lone surrogate) before they reach a shell, a file or the tokenizer.
Special-token text (``<|im_end|>``) is not touched here: the chat encoder keeps it plain text
(:mod:`jaxrl_term.agent.chat`).

Reasoning follows the chat template: only the text up to the first ``</think>`` is reasoning, whether or not
the reply opened it (templates that pre-fill ``<think>`` leave the model only the closing tag to write).
"""

from __future__ import annotations

import re
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean(text: str) -> str:
    """``text`` with every lone surrogate replaced by U+FFFD (encodable as UTF-8)."""
    return _SURROGATE.sub("\ufffd", text)


def clean_value(value: Any, _depth: int = 0) -> Any:
    """Strings inside ``value`` (dict keys and values, list and tuple items) cleaned; other values as they are.
    Past a nesting depth of 100 a structure is replaced by a note (no tool argument is that deep)."""
    if isinstance(value, str):
        return clean(value)
    if _depth > 100 and isinstance(value, (dict, list, tuple)):
        return "[nested too deeply]"
    if isinstance(value, dict):
        return {clean_value(k, _depth + 1): clean_value(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clean_value(v, _depth + 1) for v in value)
    return value


def split_thinking(text: str) -> tuple[str, str]:
    """``(reasoning, rest)``: the reasoning is the text up to the first ``</think>`` (as the chat template
    splits it); without one, a reply that opens with ``<think>`` is still thinking (it was cut off), and any
    other reply has no reasoning. A ``<think>`` elsewhere (a file's content, a command) is ordinary text."""
    at = text.find(THINK_CLOSE)
    if at >= 0:
        return text[:at], text[at + len(THINK_CLOSE):]
    if text.lstrip().startswith(THINK_OPEN):
        return text, ""
    return "", text


def head_tail(text: str, limit: int, note: str = "\n[... {n} characters truncated ...]\n") -> str:
    """``text`` cut to its first and last characters, ``limit`` in all, with ``note`` (``{n}``: how many were
    dropped) between them."""
    if len(text) <= limit:
        return text
    head = limit // 2
    return text[:head] + note.format(n=len(text) - limit) + text[len(text) - (limit - head):]
