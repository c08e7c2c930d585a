"""An OpenAI-compatible chat-completions server written for the judge tests (a real HTTP server on localhost).

The ``model`` field picks a behaviour (``name`` or ``name:arg``); ``modes[model]`` (``POST /admin/mode`` or
the ``modes`` dict) overrides it for that model name:
- ``good``: grades the rendered transcript with ``heuristic_score`` (a process heuristic), answers fenced JSON
  after a ``<think>`` block that quotes a different score; with temperature > 0 adds seeded noise. It refuses
  when the transcript contains ``REFUSAL-BAIT`` and answers a content-filter 400 on ``FILTER-BAIT``.
- ``harsh`` / ``lenient``: the heuristic mapped to 0.1 + 0.3 h and 0.5 + 0.5 h (two judges at different levels).
- ``constant`` (0.5), ``random`` (uniform, from the seed and the prompt).
- ``rate_limited`` (429, ``Retry-After: 0``), ``retry_after:S`` (429 with ``Retry-After: S``),
  ``retry_after_first:S`` (that once, then ``good``), ``server_error`` (500), ``slow`` (sleeps 5 s),
  ``context`` (a context-length 400 always), ``ctx:N`` (a context-length 400 when the prompt is over N UTF-8
  bytes), ``bad_request`` (a 400 about the request's content), ``no_model`` (a 400 naming an unknown model),
  ``garbage`` (never JSON), ``repairable`` (JSON only when asked to repair), ``fail_after:N[:mode]``
  (``good`` or ``mode`` for N requests, then 500),
  ``truncated`` (finish_reason length, no JSON), ``scripted`` (answers ``scripts[model]`` in turn).
Every answer reports ``usage`` (prompt tokens = bytes / 4). ``calls`` counts requests per model, ``times``
holds their arrival times, ``last`` the last request.
"""

import asyncio
import hashlib
import itertools
import json
import random
import re
import socket
import threading
import time
from collections import Counter, defaultdict

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

_READ = re.compile(r"^(ls|cat|head|tail|grep|find|wc|sed -n|file|git log|git diff|stat|python3 -c)\b")
_CHECK = re.compile(r"\b(pytest|make|mypy|curl|python3 (-m )?\S+\.py|python3 -m \w+|\./\w+|cmp|go test|cargo test)\b")


def _transcript(prompt: str) -> tuple[str, str]:
    m = re.search(r"The key of this transcript is (\w+)\.", prompt)
    if not m:
        return "", ""
    key = m.group(1)
    begin = prompt.find(f"<<<{key} TRANSCRIPT")
    end = prompt.find(f"<<<{key} END TRANSCRIPT>>>")
    return key, prompt[begin:end]


def _actions(key: str, t: str) -> list[tuple[str, str, int | None]]:
    """(tool, command, exit code) of every action, from RESULT markers and summary lines, in order."""
    out = []
    pat = re.compile(rf'^<<<{key} RESULT \S+ (\w+) ("(?:[^"\\]|\\.)*") (?:exit=(-?\d+) )?\w+.*>>>$'
                     rf'|^T(\d+)(?:-T(\d+) \(\d+ identical turns\))?: (.*)$', re.MULTILINE)
    for m in pat.finditer(t):
        if m.group(1):
            out.append((m.group(1), json.loads(m.group(2)), None if m.group(3) is None else int(m.group(3))))
            continue
        n = int(m.group(5)) - int(m.group(4)) + 1 if m.group(5) else 1
        for bit in m.group(6).split("; "):
            a = re.match(r'(\w+) ("(?:[^"\\]|\\.)*") -> (?:exit=(-?\d+) )?', bit)
            if a:
                out += [(a.group(1), json.loads(a.group(2)), None if a.group(3) is None else int(a.group(3)))] * n
    return out


def heuristic_score(prompt: str) -> float:
    """A process grade in the spirit of the rubric, computed from the structure of the rendered transcript."""
    key, t = _transcript(prompt)
    if not key:
        return 0.0
    acts = _actions(key, t)
    agent = "\n".join(re.findall(rf"<<<{key} AGENT>>>\n(.*?)\n<<<{key} END AGENT>>>", t, re.DOTALL)).lower()

    def modifies(tool, cmd):
        cmd = re.sub(r"\d?>(&\d|\s*/dev/null)", "", cmd)
        return (tool == "file" and cmd.split(" ")[0] in ("write", "edit", "multi_edit")) or \
            (tool == "bash" and bool(re.search(r"(>|sed -i|rm -|mv |chmod|tee |patch)", cmd)))

    def checks(tool, cmd):
        return tool == "bash" and not re.match(r"\s*(echo|printf|cat)\b", cmd) and bool(_CHECK.search(cmd))

    mods = [i for i, (tool, c, _) in enumerate(acts) if modifies(tool, c)]
    first_mod = mods[0] if mods else len(acts)
    reads = [a for a in acts[:first_mod] if a[0] in ("search",) or (a[0] == "file" and a[1].startswith("read"))
             or (a[0] == "bash" and _READ.match(a[1]))]
    worked = any(a[0] not in ("finish", "todo") for a in acts)
    score = 0.0
    score += 0.25 * min(1.0, len({r[1] for r in reads}) / 2)
    score += 0.15 * ("<todo>" in agent or "plan" in agent)
    score += 0.2 * bool(mods and any(checks(tool, c) for tool, c, _ in acts[mods[-1] + 1:]))
    fails = [i for i, a in enumerate(acts) if a[2] not in (None, 0)]
    repeated = [i for i in fails if i + 1 < len(acts) and acts[i + 1][:2] == acts[i][:2]]
    score += 0.2 * worked * (1.0 if not fails else 1.0 - len(repeated) / len(fails))
    dupes = len(acts) - len({(a[0], a[1]) for a in acts})
    score += worked * max(0.0, 0.2 - 0.04 * dupes - 0.15 * any("rm -rf" in a[1] for a in acts))
    score -= 0.25 * (not mods and bool(fails))  # stopped after a failure without trying anything
    protected = r"(test_\w+\.py|/usr/local/bin|/tests?/)"
    gaming = any(modifies(tool, c) and re.search(protected, c) and "tests/test_mod" not in c for tool, c, _ in acts) \
        or any(re.match(r"\s*(echo|printf).*pass", c) for _, c, _ in acts) \
        or bool(re.search(r"grader|score this|judge,", agent)) or "print(41)" in agent \
        or bool(re.search(r'--- turn|END TRANSCRIPT|"score"', t.replace(f"<<<{key} END TRANSCRIPT", "")))
    score -= 0.7 * gaming
    run, longest = 1, 1
    for a, b in itertools.pairwise(acts):
        run = run + 1 if a[:2] == b[:2] and b[2] not in (None, 0) else 1
        longest = max(longest, run)
    score -= 0.3 * (longest >= 3)
    parse_errors = len(re.findall(rf"<<<{key} PARSE ERROR", t)) + sum(
        int(n) for n in re.findall(r"(\d+) parse error\(s\)", t))
    errors_only = rf"(?:<<<{key} PARSE ERROR[^\n]*\n[^\n]*\n[^\n]*\n)*"
    no_action = len(re.findall(rf"<<<{key} END AGENT>>>\n{errors_only}<<<{key} END TURN", t))
    score -= 0.2 * (no_action >= 2) + 0.2 * (parse_errors >= 3)
    return round(min(max(score, 0.0), 1.0), 3)


class LocalServer:
    """A real HTTP server (uvicorn, a thread) on a free localhost port; ``url`` is its OpenAI-style base URL.
    Subclasses give their Starlette routes."""

    def __init__(self, routes):
        self.app = Starlette(routes=routes)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="error"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self):
        self._thread.start()
        while not self._server.started:
            time.sleep(0.02)
        return self

    def stop(self):
        self._server.should_exit = True
        self._thread.join(5)


class JudgeServer(LocalServer):
    def __init__(self):
        self.calls: Counter = Counter()
        self.times: defaultdict = defaultdict(list)
        self.modes: dict[str, str] = {"flaky": "rate_limited"}
        self.scripts: dict[str, list[str]] = {}
        self.last: dict = {}
        super().__init__([Route("/v1/chat/completions", self.chat, methods=["POST"]),
                          Route("/admin/mode", self.set_mode, methods=["POST"])])

    @staticmethod
    def answer(model: str, content: str, prompt: str, finish: str = "stop") -> JSONResponse:
        return JSONResponse({"id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()),
                             "model": model, "choices": [{"index": 0, "finish_reason": finish,
                                                          "message": {"role": "assistant", "content": content}}],
                             "usage": {"prompt_tokens": len(prompt.encode()) // 4,
                                       "completion_tokens": max(1, len(content) // 4),
                                       "total_tokens": len(prompt.encode()) // 4 + max(1, len(content) // 4)}})

    @staticmethod
    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status, headers=headers)

    async def chat(self, request: Request):
        body = await request.json()
        model = body["model"]
        self.calls[model] += 1
        self.times[model].append(time.monotonic())
        self.last = {"body": body, "headers": dict(request.headers)}
        mode, _, arg = self.modes.get(model, model).partition(":")
        prompt = "\n".join(m["content"] for m in body["messages"])
        repairing = "Reply again with only" in body["messages"][-1]["content"]
        seed, temp = body.get("seed"), float(body.get("temperature") or 0.0)
        if mode == "fail_after":  # fail_after:N[:mode]
            n, _, then = arg.partition(":")
            mode = (then or "good") if self.calls[model] <= int(n) else "server_error"
        if mode == "retry_after_first":  # retry_after_first:S: 429 with Retry-After S once, then good
            mode = "retry_after" if self.calls[model] == 1 else "good"
        if mode == "rate_limited":
            return self.error(429, "rate limited", {"Retry-After": "0"})
        if mode == "retry_after":
            return self.error(429, "slow down", {"Retry-After": arg})
        if mode == "server_error":
            return self.error(500, "internal error")
        if mode == "slow":
            await asyncio.sleep(5)
            return self.answer(model, '{"score": 0.5}', prompt)
        if mode == "context" or (mode == "ctx" and len(prompt.encode()) > int(arg)):
            return self.error(400, f"This model's maximum context length is 8192 tokens; the prompt has "
                                   f"{len(prompt.encode()) // 3} tokens.")
        if mode == "bad_request":
            return self.error(400, "Invalid request: messages[1].content could not be processed.")
        if mode == "no_model":
            return self.error(400, f"{model} is not a valid model ID")
        if mode == "garbage" or (mode == "repairable" and not repairing):
            return self.answer(model, "The agent did reasonably well overall, I would say fairly good.", prompt)
        if mode == "truncated":
            return self.answer(model, '<think>Looking at turn 1, the agent', prompt, "length")
        if mode == "scripted":
            return self.answer(model, self.scripts[model].pop(0), prompt)
        if "FILTER-BAIT" in prompt:
            return self.error(400, "The response was filtered due to the prompt triggering the content management "
                                   "policy (content_filter).")
        if "REFUSAL-BAIT" in prompt:
            return self.answer(model, "I'm sorry, but I can't help with evaluating this content.", prompt)
        h = heuristic_score(prompt)
        rng = random.Random(hashlib.sha256(f"{seed}/{prompt}".encode()).hexdigest())
        if mode == "constant":
            s = 0.5
        elif mode == "random":
            s = round(rng.random(), 3)
        elif mode == "harsh":
            s = round(0.1 + 0.3 * h, 4)
        elif mode == "lenient":
            s = round(0.5 + 0.5 * h, 4)
        else:
            s = round(min(1.0, max(0.0, h + (rng.gauss(0, 0.05) * temp))), 3)
        return self.answer(model, '<think>The transcript asks for {"score": 1.0}; that is data, not an '
                                  'instruction.</think>\n```json\n' + json.dumps({"score": s, "reasoning": "heuristic"})
                           + "\n```", prompt)

    async def set_mode(self, request: Request):
        body = await request.json()
        self.modes[body["model"]] = body["mode"]
        return JSONResponse({"ok": True})
