"""The judge's answer -> one score in [0, 1], strictly, or ``ValueError``.

The answer is whatever the judge wrote after reading a transcript the policy wrote, so it may quote the
policy's own ``{"score": 1.0}``. The rule: reasoning blocks (``<think>…</think>`` and kin) are removed; the
score is the ``score`` field of the *last complete top-level* JSON value, found by scanning with
``json.JSONDecoder.raw_decode`` (so an object quoted inside a string or nested in another object is never a
candidate); that value must be an object whose ``score`` is a finite number in [0, 1] (not a bool, not a
string, no duplicate ``score`` key, no NaN, no differing ``score`` nested in it). Any other score outside
that object (an earlier object, a draft,
``score: 0.9`` prose or YAML, a truncated later object) that differs from it makes the answer *conflicting*:
rejected, and the client asks once for a repair. YAML answers are not accepted.
"""

from __future__ import annotations

import json
import math
import re

MAX_ANSWER_CHARS = 200_000  # a judge answer is bounded by max_tokens; anything larger is not an answer
MAX_SCAN_FACTOR = 20  # scanning may go through the answer this many times (answers in practice: about once)
_REASONING_TAGS = ("think", "thinking", "reasoning", "analysis", "reflection")
_VALUE_START = re.compile(r"[{\[]")
# a score stated outside the final object: "score": 0.9 / score: 0.9 / 'score' = 0.9 / score is 0.9 / score of 0.9
_SCORE_MENTION = re.compile(r"""(?i)["']?\bscore\b["']?\s*(:|=|\bis\b|\bof\b)\s*["']?([^\s,;}"'\]]*)""")
_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?", re.IGNORECASE)


class ConflictingScores(ValueError):
    pass


def strip_reasoning(text: str) -> str:
    """``text`` without reasoning blocks. A closing tag with no opening one (the chat template opened the block
    in the prompt) removes everything before it; an opening tag never closed removes everything after it."""
    for tag in _REASONING_TAGS:
        text = re.sub(rf"<{tag}\b[^>]*>.*?</{tag}\s*>", "", text, flags=re.DOTALL | re.IGNORECASE)
        closes = list(re.finditer(rf"</{tag}\s*>", text, flags=re.IGNORECASE))
        if closes:
            text = text[closes[-1].end():]
        m = re.search(rf"<{tag}\b[^>]*>", text, flags=re.IGNORECASE)
        if m:
            text = text[:m.start()]
    return text


def _no_duplicate_score(pairs):
    keys = [k for k, _ in pairs]
    if keys.count("score") > 1:
        raise ConflictingScores("an object has two 'score' keys")
    return dict(pairs)


def _no_constants(name):
    raise ValueError(f"{name} is not a number")


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicate_score, parse_constant=_no_constants)


def top_level_values(text: str) -> list[tuple[int, int, object]]:
    """Every complete top-level JSON object or array in ``text``: (start, end, value), in order. Scanning resumes
    after each value found, so values nested in it (or quoted in its strings) are not listed."""
    out, i = [], 0
    work = 0  # characters the decoder went through: failed attempts that each scan far would be quadratic
    while (m := _VALUE_START.search(text, i)) is not None:
        try:
            value, end = _DECODER.raw_decode(text, m.start())
        except ConflictingScores:
            raise
        except RecursionError as e:  # no judge nests ~1000 deep
            raise ValueError("the answer nests brackets deeper than the JSON decoder allows") from e
        except ValueError as e:
            work += max(1, getattr(e, "pos", m.start()) - m.start())
            if work > MAX_SCAN_FACTOR * len(text) + 100_000:
                raise ValueError("the answer's brackets are too tangled to parse (it is not a judgement)") from e
            i = m.start() + 1
            continue
        out.append((m.start(), end, value))
        i = end
    return out


def _nested_scores(value) -> list:
    """Every ``score`` value nested inside ``value``'s objects and arrays (not inside strings)."""
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            out += [x for k, x in v.items() if k.lower() == "score"]
            stack += list(v.values())
        elif isinstance(v, list):
            stack += v
    return out


def _as_number(token: str) -> float | None:
    m = _NUMBER.match(token)
    return float(m.group(0)) if m else None


def parse_score(text: str) -> tuple[float, str]:
    """(score, reasoning) from a judge answer; ``ValueError`` (``ConflictingScores`` for conflicts) otherwise."""
    if len(text) > MAX_ANSWER_CHARS:
        raise ValueError(f"the answer has {len(text)} characters; a judge answer has at most {MAX_ANSWER_CHARS}")
    body = strip_reasoning(text)
    values = top_level_values(body)
    if not values:
        raise ValueError("no JSON object outside the reasoning")
    start, end, obj = values[-1]
    if not isinstance(obj, dict) or "score" not in obj:
        raise ValueError("the last JSON value is not an object with a 'score' field")
    s = obj["score"]
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s):
        raise ValueError(f"score is not a finite number: {s!r}")
    if not 0.0 <= float(s) <= 1.0:
        raise ValueError(f"score {s} is outside [0, 1]")
    inner = {**obj, "score": None}
    for other in _nested_scores(inner):  # {"score": 0.2, "breakdown": {"score": 1.0}}: which one?
        if other is not None and (not isinstance(other, (int, float)) or isinstance(other, bool)
                                  or abs(float(other) - float(s)) > 1e-9):
            raise ConflictingScores(f"the final object holds another score ({other!r}) besides {s}")
    outside = body[:start] + "\n" + body[end:]
    for m in _SCORE_MENTION.finditer(outside):
        other = _as_number(m.group(2))
        if other is None and m.group(1) in ":=":  # "score": NaN, score: high -- a claim, not a number
            raise ConflictingScores(f"the answer states a non-numeric score ({m.group(0).strip()!r})")
        if other is not None and abs(other - float(s)) > 1e-9:
            raise ConflictingScores(f"the answer states another score ({m.group(0).strip()!r}) besides the final {s}")
    reasoning = obj.get("reasoning", "")
    return float(s), reasoning if isinstance(reasoning, str) else json.dumps(reasoning)[:2000]
