"""SGLang's memory saver driven so that no call can kill a server: across trainer resumes, server restarts and
trainers that were SIGKILLed between a release and the resume.

SGLang's rules (``sglang/srt/managers/scheduler_update_weights_mixin.py``, from 0.5.20
``scheduler_components/weight_updater.py``: ``release_memory_occupation`` / ``resume_memory_occupation``;
``torch_memory_saver`` ``csrc/core.cpp``: ``pause`` / ``resume``):

* release adds its tags to the scheduler's ``offload_tags`` and unmaps their memory. Releasing a tag that is already
  released exits the scheduler ("Cannot pause allocation that is not active"); so does a release while requests
  run (an ``AssertionError`` from 0.5.5).
* resume first removes each tag from ``offload_tags``: a tag that was not released raises ``KeyError``. Any
  exception in the scheduler kills the whole server (``run_scheduler_process`` sends SIGQUIT to its parent, which
  kills the process tree). Every resume after a trainer restart used to do exactly that.
* the memory comes back uninitialised: the weights are undefined until the next weight update.
* ``/generate`` on released memory, and from 0.5.10 ``/health_generate`` (a real one-token generation), touch
  unmapped memory: the server dies.
* nothing SGLang exposes says what is released (``/server_info`` shows launch settings and static memory sizes),
  and a restarted server comes back with nothing released and its launch ``weight_version``.

So the state lives where it cannot outlive the server: its ``weight_version``, which ``/update_weight_version``
(SGLang >= 0.5.2; it touches nothing else) sets and ``/model_info`` reports. Around each call the client writes
a marker ``<version>|jaxrl-memory:<state>:<tags>``::

    release:  releasing:T -> POST /release_memory_occupation {T} -> released:T
    resume:   resuming:T  -> POST /resume_memory_occupation {T}  -> resumed   (weights undefined)
    the next /update_weights_from_disk {weight_version} replaces the marker with the new version

A server without a marker has nothing released by us (fresh, or restarted: it shows its launch version) and is
never resumed. ``released`` left by a dead trainer is resumed by the next client. ``releasing`` or ``resuming``
mean a client died inside the call; SGLang offers no way to learn whether it took effect and either guess can kill
the server, so the client refuses and names the server to restart. These calls are sent once, never retried (a
retried release is a double release). A server without ``/update_weight_version`` (404) is tracked in this
client's memory only, which cannot see a restart (warned once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import httpx

from jaxrl_term.rollout.engine import EngineError


log = logging.getLogger(__name__)
MARK = "|jaxrl-memory:"
IN_DOUBT = ("releasing", "resuming")


@dataclasses.dataclass(frozen=True)
class MemoryState:
    """One server's state as its ``weight_version`` tells it. ``state``: "" (nothing released by a client of
    ours), ``releasing``, ``released``, ``resuming`` or ``resumed`` (memory back, weights undefined)."""

    version: str | None
    state: str = ""
    tags: tuple[str, ...] = ()

    @classmethod
    def parse(cls, weight_version) -> MemoryState:
        wv = None if weight_version is None else str(weight_version)
        if wv is None or MARK not in wv:
            return cls(wv)
        version, _, rest = wv.rpartition(MARK)
        state, _, tags = rest.partition(":")
        return cls(version, state, tuple(t for t in tags.split(",") if t))

    def marker(self) -> str:
        return f"{self.version}{MARK}{self.state}:{','.join(self.tags)}" if self.state else str(self.version)

    @property
    def released(self) -> tuple[str, ...]:
        return self.tags if self.state == "released" else ()


class ServerMemory:
    """What each of an engine's servers has released, kept in the servers themselves (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.local: list[set[str]] = [set() for _ in engine.urls]  # what this client released
        self.marks = [True] * len(engine.urls)  # False: the server has no /update_weight_version

    def _url(self, i: int) -> str:
        return self.engine.urls[i]

    async def state(self, i: int, attempts: int = 3) -> MemoryState:
        """The server's state (``/model_info``, safe in every state; a lost connection is tried again)."""
        for k in range(attempts):
            try:
                return MemoryState.parse((await self.engine.model_info(i)).get("weight_version"))
            except EngineError as e:
                if not e.retryable or k == attempts - 1:
                    raise
                await asyncio.sleep(0.2 * 2**k)
        raise AssertionError("unreachable")

    async def _send(self, i: int, path: str, body: dict) -> httpx.Response:
        """One POST, never retried; a lost connection raises (the call may or may not have taken effect)."""
        try:
            return await self.engine.client.post(self._url(i) + path, json=body)
        except httpx.HTTPError as e:
            raise EngineError(f"{self._url(i)}{path}: {type(e).__name__}: {e}") from e

    async def _mark(self, i: int, st: MemoryState) -> None:
        if not self.marks[i]:
            return
        r = await self._send(i, "/update_weight_version", {"new_version": st.marker(), "abort_all_requests": False})
        if r.status_code == 404:
            self.marks[i] = False
            log.warning("%s has no /update_weight_version (SGLang < 0.5.2?): what it released is known to this "
                        "client only, and a restart of it cannot be seen", self._url(i))
        elif r.status_code >= 400:
            raise EngineError(f"{self._url(i)}/update_weight_version: HTTP {r.status_code}: {r.text[:300]}",
                              retryable=False)

    def _in_doubt(self, i: int, st: MemoryState) -> EngineError:
        call = "release" if st.state == "releasing" else "resume"
        return EngineError(
            f"{self._url(i)}: a client stopped inside /{call}_memory_occupation {list(st.tags)} (weight_version "
            f"{st.marker()!r}). SGLang does not say whether that call took effect, and a wrong guess kills the "
            "server (a resume of a tag not released raises KeyError, a second release exits torch_memory_saver): "
            "restart this server", retryable=False)

    async def _control(self, i: int, path: str, tags: list[str], undo: MemoryState) -> None:
        r = await self._send(i, path, {"tags": tags})
        if r.status_code >= 400:  # answered: the scheduler did not act on it
            await self._mark(i, undo)
            raise EngineError(f"{self._url(i)}{path}: HTTP {r.status_code}: {r.text[:300]}", retryable=False)

    async def release(self, i: int, tags: list[str]) -> None:
        """Release the ``tags`` of server ``i`` that are not released yet."""
        st = await self.state(i)
        if st.state in IN_DOUBT:
            raise self._in_doubt(i, st)
        held = set(st.released) | (set() if self.marks[i] else self.local[i])
        todo = [t for t in tags if t not in held]
        if not todo:
            return
        now = (*st.released, *todo)
        # SGLang asserts idleness in release (the server dies otherwise); a generation the client gave up on runs on
        # until the server notices the disconnect, so wait until /flush_cache says nothing runs or waits
        await self.engine._wait_idle(i)
        await self._mark(i, MemoryState(st.version, "releasing", now))
        await self._control(i, "/release_memory_occupation", todo, undo=st)
        await self._mark(i, MemoryState(st.version, "released", now))
        self.local[i].update(todo)

    async def resume(self, i: int, tags: list[str] | None = None) -> list[str]:
        """Resume what server ``i`` has released (of ``tags``, default all); returns the tags resumed."""
        st = await self.state(i)
        if st.state in IN_DOUBT:
            raise self._in_doubt(i, st)
        if self.marks[i]:
            if self.local[i] and not st.released:
                log.warning("%s reports weight_version %r, not what it was released with: restarted, so nothing of "
                            "it is released; it is not resumed", self._url(i), st.version)
                self.local[i].clear()
            held = st.released
        else:
            held = tuple(t for t in ("weights", "kv_cache", "cuda_graph") if t in self.local[i])
        todo = [t for t in held if tags is None or t in tags]
        if not todo:
            return []
        rest = tuple(t for t in held if t not in todo)
        await self._mark(i, MemoryState(st.version, "resuming", tuple(todo)))
        await self._control(i, "/resume_memory_occupation", todo, undo=st)
        await self._mark(i, MemoryState(st.version, "released", rest) if rest else MemoryState(st.version, "resumed"))
        self.local[i].difference_update(todo)
        return todo

    async def attach(self, i: int, deadline_s: float) -> None:
        """A new client meets server ``i``: wait until it answers, resume what a dead client left released (before
        any ``/health_generate``), and continue it in case one was killed while it was paused."""
        t_end = time.monotonic() + deadline_s
        while True:
            try:
                st = await self.state(i, attempts=1)
                break
            except EngineError as e:
                if not e.retryable or time.monotonic() > t_end:
                    raise
                await asyncio.sleep(0.25)
        if st.state in IN_DOUBT:
            raise self._in_doubt(i, st)
        if st.released:
            log.warning("%s was left with %s released (weight_version %r): resuming it; its weights are undefined "
                        "until the next weight update", self._url(i), list(st.released), st.marker())
            await self.resume(i)
        r = await self._send(i, "/continue_generation", {})  # a no-op unless paused
        if r.status_code >= 400:
            raise EngineError(f"{self._url(i)}/continue_generation: HTTP {r.status_code}: {r.text[:300]}",
                              retryable=False)


async def each_server(engine, what: str, calls) -> None:
    """Run one coroutine per server; raise one ``EngineError`` naming every server that failed."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    errors = [f"{url}: {e}" for url, e in zip(engine.urls, results) if isinstance(e, Exception)]
    if errors:
        raise EngineError(f"{what} failed on {len(errors)} server(s): {'; '.join(errors)}", retryable=False)


class WeightCycle:
    """The servers' side of a synchronous RL step, as the trainer drives it: ``attach`` once at start-up,
    ``release`` before each update (``time_share`` only: the trainer then has the GPUs), ``load`` after it (and
    first thing on a resume): resume whatever is released, then load the new weights."""

    def __init__(self, engine, *, time_share: bool):
        self.engine, self.time_share = engine, time_share

    async def attach(self, ready_timeout_s: float) -> None:
        mem = self.engine.memory
        await each_server(self.engine, "attach", (mem.attach(i, ready_timeout_s) for i in range(len(mem.local))))
        await self.engine.wait_ready(ready_timeout_s)

    async def release(self) -> None:
        if self.time_share:
            await self.engine.release_memory()

    async def load(self, source, version: int) -> None:
        await self.engine.resume_memory()  # the weights of a resumed server are undefined: always load after it
        await self.engine.update_weights(source, version)
