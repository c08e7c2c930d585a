"""An OpenAI-compatible chat-completions server written for the judge tests (a real HTTP server on localhost).

The ``model`` field picks a behaviour: ``good`` grades with a simple heuristic and answers JSON,
``rate_limited`` answers 429, ``slow`` sleeps past any sensible timeout, ``garbage`` never answers JSON,
``repairable`` answers JSON only when asked to repair, ``context`` answers a context-length 400,
``flaky`` does whatever ``POST /admin/mode`` last said (``429`` or ``ok``). ``GET /admin/calls`` counts
requests per model; ``GET /admin/last`` returns the last request body and headers.
"""

import asyncio
import json
import re
import socket
import threading
import time
from collections import Counter

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


def heuristic_score(prompt: str) -> float:
    m = re.search(r"<<<TRANSCRIPT (\w+)>>>\n(.*)\n<<<END TRANSCRIPT \1>>>", prompt, re.S)
    t = m.group(2).lower() if m else ""
    score = 0.3
    score += 0.15 * ("<todo>" in t)
    score += 0.15 * bool(re.search(r"\b(ls|cat|head|grep|read)\b", t.split("action: edit")[0]))
    score += 0.3 * ("pytest" in t and "passed" in t)
    score -= 0.6 * ("test_report.py\nold_string" in t or "/usr/local/bin/pytest" in t or "print(41)" in t)
    score -= 0.3 * (t.count("[parse error]") >= 2)
    score -= 0.3 * (t.count("no such file or directory") >= 3)
    score -= 0.25 * ("<finish>" in t and "[bash result" not in t)
    return round(min(max(score, 0.0), 1.0), 3)


class JudgeServer:
    def __init__(self):
        self.calls: Counter = Counter()
        self.modes: dict[str, str] = {"flaky": "429"}
        self.last: dict = {}
        self.app = Starlette(routes=[
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/admin/mode", self.set_mode, methods=["POST"]),
            Route("/admin/calls", self.get_calls, methods=["GET"]),
            Route("/admin/last", self.get_last, methods=["GET"]),
        ])
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

    @staticmethod
    def answer(model: str, content: str) -> JSONResponse:
        return JSONResponse({"id": "chatcmpl-test", "object": "chat.completion", "created": int(time.time()),
                             "model": model, "choices": [{"index": 0, "finish_reason": "stop",
                                                          "message": {"role": "assistant", "content": content}}],
                             "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})

    async def chat(self, request: Request):
        body = await request.json()
        model = body["model"]
        self.calls[model] += 1
        self.last = {"body": body, "headers": dict(request.headers)}
        mode = self.modes.get(model, model)
        prompt = "\n".join(m["content"] for m in body["messages"])
        repairing = "was not a JSON object" in body["messages"][-1]["content"]
        if mode in ("rate_limited", "429"):
            return JSONResponse({"error": {"message": "rate limited"}}, status_code=429,
                                headers={"Retry-After": "0"})
        if mode == "slow":
            await asyncio.sleep(5)
            return self.answer(model, '{"score": 0.5}')
        if mode == "context":
            return JSONResponse({"error": {"message": "This model's maximum context length is 8192 tokens."}},
                                status_code=400)
        if mode == "garbage" or (mode == "repairable" and not repairing):
            return self.answer(model, "The agent did reasonably well overall, I would say fairly good.")
        s = heuristic_score(prompt)
        return self.answer(model, "```json\n" + json.dumps({"score": s, "reasoning": "heuristic"}) + "\n```")

    async def set_mode(self, request: Request):
        body = await request.json()
        self.modes[body["model"]] = body["mode"]
        return JSONResponse({"ok": True})

    async def get_calls(self, request: Request):
        return JSONResponse(dict(self.calls))

    async def get_last(self, request: Request):
        return JSONResponse(self.last)
