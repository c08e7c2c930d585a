"""Start SGLang servers on this node: ``python -m sglang.launch_server`` in SGLang's own environment.

The launcher binds ``0.0.0.0`` by default and advertises a name other nodes can reach; servers get ``SIGKILL``
when the process (thread) that started them dies, and never see ``SGLANG_RETURN_ORIGINAL_LOGPROB``: the
trainer's log-probs are temperature-scaled over the full vocabulary, SGLang's default only while that variable
(``RETURN_ORIGINAL_LOGPROB`` in 0.5.2-0.5.3) is unset. Flags follow SGLang's ``server_args.py``:
``--enable-fp32-lm-head`` and ``--enable-deterministic-inference`` (>= 0.5.3), ``--weight-version`` (>= 0.5.1),
``--enable-memory-saver``.

Context past the model's trained range, only on purpose: with ``rope_scaling`` (YaRN) the servers get
``--json-model-override-args '{"rope_scaling": {...}, "rope_parameters": {...}}'`` unless the model's config.json
already has that scaling (SGLang's ``get_config`` applies it with ``config.update``), and
``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1`` exactly when ``--context-length`` exceeds the length SGLang derives
from the config (``sglang_context_length``), which it otherwise refuses (``ModelConfig._derive_context_length``). A
context beyond the scaled range is refused here.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from jaxrl_term.rollout.engine import EngineError

log = logging.getLogger(__name__)
# the log-prob semantics the trainer needs: SGLang's default, which these variables turn off
LOGPROB_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB")
# SGLang refuses --context-length above the derived length unless this is set (srt/configs/model_config.py)
ALLOW_LONGER_CONTEXT_ENV = "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"
# srt/utils/hf_transformers_utils.py CONTEXT_LENGTH_KEYS: the first one present wins
CONTEXT_LENGTH_KEYS = ("max_sequence_length", "seq_length", "max_seq_len", "model_max_length",
                       "max_position_embeddings")


def sglang_context_length(hf_config: Mapping[str, Any]) -> int:
    """The context length SGLang derives from an HF config dict (``get_context_length``): the first of
    ``CONTEXT_LENGTH_KEYS`` (2048 if none), times ``rope_scaling.factor`` only when the scaling has no
    ``original_max_position_embeddings`` and is not llama3. Under transformers v5 SGLang's ``config.rope_scaling``
    is the standardised ``rope_parameters``, which always carries ``original_max_position_embeddings`` for YaRN,
    so the factor never applies; the smaller of the two readings is returned."""
    base = next((int(hf_config[k]) for k in CONTEXT_LENGTH_KEYS if hf_config.get(k) is not None), 2048)

    def factor(rs) -> float:
        if not rs or "original_max_position_embeddings" in rs or rs.get("rope_type") == "llama3":
            return 1.0
        return float(rs.get("factor", 1))

    v4 = factor(hf_config.get("rope_scaling"))
    v5_rs = hf_config.get("rope_scaling") or hf_config.get("rope_parameters") or {}
    v5 = 1.0 if (v5_rs.get("rope_type") or v5_rs.get("type")) in ("yarn", "llama3", "longrope") else factor(v5_rs)
    return int(min(v4, v5) * base)

@dataclasses.dataclass
class ServerSpec:
    port: int
    gpus: str | None = None  # CUDA_VISIBLE_DEVICES, e.g. "0,1"
    tp_size: int = 1


def default_advertise_host() -> str:
    """A name other nodes can reach this node by: the FQDN when it resolves to a non-loopback address, else
    the address of the default route's interface."""
    name = socket.getfqdn()
    try:
        addrs = {ai[4][0].split("%")[0] for ai in socket.getaddrinfo(name, None)}
    except OSError:
        addrs = set()
    if addrs and not any(ipaddress.ip_address(a).is_loopback for a in addrs):
        return name
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("8.8.8.8", 53))  # UDP: sends nothing; the kernel picks the default route's source address
            return s.getsockname()[0]
        except OSError:
            pass
    log.warning("no routable name or address found for this node (FQDN %r is loopback, no default route); "
                "set rollout.sglang.launch.advertise_host", name)
    return socket.gethostname()


# Exec'd in front of a server's command (Linux): SIGKILL when the thread that started it dies (PR_SET_PDEATHSIG,
# kept across exec), or at once if the trainer is already gone; then the server runs in this same process.
_PDEATHSIG_HOP = r"""
import os, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)
except (ImportError, OSError, AttributeError):  # no prctl: the server runs on without it, as it would elsewhere
    pass
if os.getppid() != int(sys.argv[1]):
    os.kill(os.getpid(), 9)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def die_with_parent() -> list[str]:
    """The argv to put in front of a server's command so it dies with the trainer (Linux; elsewhere nothing).
    A fresh interpreter does it, never a ``preexec_fn``: that forks the multithreaded trainer with every
    library's atfork handlers run while the GIL is held, a rare deadlock (see sandbox/confine.py)."""
    if not sys.platform.startswith("linux"):
        return []
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_HOP, str(os.getpid())]


class SGLangLauncher:
    """Start ``python -m sglang.launch_server`` processes (in SGLang's own environment: ``python``), wait until
    each answers ``/health_generate``, stop them cleanly (SIGTERM to the process group, then SIGKILL).

    ``host``: the bind address (``0.0.0.0``: reachable from other nodes; SGLang's own default is 127.0.0.1,
    loopback only). ``urls`` use ``advertise_host`` (default: 127.0.0.1 for a loopback bind, else this node's
    FQDN or default-route address). Servers die with the thread that called ``start`` (PR_SET_PDEATHSIG; SGLang's
    scheduler and detokenizer processes do the same towards the server process), so call it from the main
    thread. ``fp32_lm_head`` (SGLang >= 0.5.3), ``memory_saver``, ``deterministic`` (>= 0.5.3) and
    ``weight_version`` (>= 0.5.1) add the matching flags."""

    def __init__(self, model_path: str, servers: Sequence[ServerSpec], *, python: str = "python",
                 module: str = "sglang.launch_server", host: str = "0.0.0.0", advertise_host: str | None = None,
                 mem_fraction_static: float = 0.7, context_length: int | None = None, fp32_lm_head: bool = False,
                 memory_saver: bool = False, deterministic: bool = False, weight_version: str | int | None = None,
                 extra_args: Sequence[str] = (), log_dir: str = "runs/sglang",
                 rope_scaling: Mapping[str, Any] | None = None):
        self.model_path, self.servers, self.python, self.module = model_path, list(servers), python, module
        self.host, self.mem, self.ctx, self.extra = host, mem_fraction_static, context_length, list(extra_args)
        self.fp32_lm_head, self.memory_saver, self.deterministic = fp32_lm_head, memory_saver, deterministic
        self.weight_version = weight_version
        self.rope_scaling = dict(rope_scaling) if rope_scaling is not None else None
        self._advertise = advertise_host
        self.log_dir = Path(log_dir)
        self.procs: list[subprocess.Popen] = []

    @property
    def advertise_host(self) -> str:
        if self._advertise is None:
            if self.host in ("127.0.0.1", "localhost"):
                self._advertise = "127.0.0.1"
            elif self.host in ("0.0.0.0", "::", ""):
                self._advertise = default_advertise_host()
            else:
                self._advertise = self.host
        return self._advertise

    @property
    def urls(self) -> list[str]:
        h = self.advertise_host
        h = f"[{h}]" if ":" in h else h
        return [f"http://{h}:{s.port}" for s in self.servers]

    def command(self, s: ServerSpec) -> list[str]:
        cmd = [self.python, "-m", self.module, "--model-path", self.model_path, "--host", self.host,
               "--port", str(s.port), "--tp-size", str(s.tp_size), "--mem-fraction-static", str(self.mem)]
        if self.ctx:
            cmd += ["--context-length", str(self.ctx)]
        if self.fp32_lm_head:
            cmd.append("--enable-fp32-lm-head")
        if self.memory_saver:
            cmd.append("--enable-memory-saver")
        if self.deterministic:
            cmd.append("--enable-deterministic-inference")
        if self.weight_version is not None:
            cmd += ["--weight-version", str(self.weight_version)]
        overrides = self.model_overrides()
        if overrides:
            if "--json-model-override-args" in self.extra:
                raise ValueError("rollout.sglang.launch.extra_args has --json-model-override-args and "
                                 "model.rope_scaling needs its own; put the scaling in model.rope_scaling only")
            cmd += ["--json-model-override-args", json.dumps(overrides, separators=(",", ":"))]
        return cmd + self.extra

    def _model_config(self) -> dict[str, Any] | None:
        path = Path(os.path.expanduser(self.model_path)) / "config.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def model_overrides(self) -> dict[str, Any]:
        """``--json-model-override-args``: the scaling under both names, ``{"rope_scaling": S, "rope_parameters":
        S}`` with ``S`` = ``rope_scaling`` + the model's rope_theta, when ``rope_scaling`` is given and config.json does
        not already mean the same under both; else {}. Both, because SGLang's Qwen3 layer reads ``rope_parameters``
        whenever it holds rope_theta (a transformers v4 config keeps that key from a v5-style config.json) and
        ``rope_scaling`` otherwise; theta rides along because under v5 the assignment replaces ``rope_parameters``."""
        if self.rope_scaling is None:
            return {}
        from jaxrl_term.model.rope import RopeScaling

        raw = self._model_config()
        if raw is None:
            raise ValueError(f"rope_scaling for the SGLang servers needs {self.model_path}/config.json here, to "
                             "compare its scaling and read rope_theta; give a local model directory")
        mpe = int(raw.get("max_position_embeddings", 40960))
        rope, legacy = raw.get("rope_parameters") or {}, raw.get("rope_scaling")
        want = RopeScaling.from_hf(self.rope_scaling, max_position_embeddings=mpe)
        readings = (legacy or rope, rope if "rope_theta" in rope else legacy)  # transformers v5's, SGLang's Qwen3's
        if all(want == RopeScaling.from_hf(r, max_position_embeddings=mpe) for r in readings):
            return {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10_000.0))
        scaling = {**(want.to_hf() if want else {"rope_type": "default"}), "rope_theta": theta}
        return {"rope_scaling": scaling, "rope_parameters": dict(scaling)}

    def needs_longer_context(self) -> bool:
        """Whether SGLang would refuse ``--context-length`` without ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``
        (above what it derives from config.json and the overrides). Raises when the context is past the model's
        own range, plain or YaRN-scaled: that is never set on purpose."""
        raw = self._model_config()
        if not self.ctx or raw is None:
            return False
        from jaxrl_term.model.rope import RopeScaling

        cfg = {**raw, **self.model_overrides()}
        mpe = int(cfg.get("max_position_embeddings", 40960))
        yarn = RopeScaling.from_hf(cfg.get("rope_scaling") or cfg.get("rope_parameters"), max_position_embeddings=mpe)
        limit = yarn.max_context if yarn else mpe
        if self.ctx > limit:
            raise ValueError(f"--context-length {self.ctx} is past the model's {limit} positions "
                             f"({'YaRN: original x factor' if yarn else 'max_position_embeddings, no rope_scaling'}); "
                             "set model.rope_scaling (YaRN) to cover it, or lower the context length")
        return self.ctx > sglang_context_length(cfg)

    def env(self, s: ServerSpec) -> dict[str, str]:
        """The server's environment: ours, without the variables that change log-prob semantics."""
        env = {k: v for k, v in os.environ.items() if k not in LOGPROB_ENV}
        dropped = [k for k in LOGPROB_ENV if k in os.environ]
        if dropped:
            log.warning("not passing %s to SGLang: the trainer needs temperature-scaled log-probs", dropped)
        if s.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = s.gpus
        if self.needs_longer_context():
            env[ALLOW_LONGER_CONTEXT_ENV] = "1"
        return env

    def start(self) -> list[str]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if threading.current_thread() is not threading.main_thread():
            log.warning("SGLangLauncher.start() outside the main thread: servers get SIGKILL when this thread ends")
        hop = die_with_parent()
        for s in self.servers:
            with open(self.log_dir / f"server-{s.port}.log", "ab") as logf:
                self.procs.append(subprocess.Popen([*hop, *self.command(s)], stdout=logf, stderr=subprocess.STDOUT,
                                                   env=self.env(s), start_new_session=True))
        return self.urls

    async def wait_ready(self, deadline_s: float = 900.0) -> None:
        t_end = time.monotonic() + deadline_s
        async with httpx.AsyncClient(timeout=30) as c:
            pending = dict(zip(self.urls, self.procs))
            while pending:
                for url, p in list(pending.items()):
                    if p.poll() is not None:
                        log_path = self.log_dir / f"server-{url.rsplit(':', 1)[1]}.log"
                        tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else ""
                        raise EngineError(f"server {url} exited with code {p.returncode}:\n{tail}", retryable=False)
                    try:
                        if (await c.get(url + "/health_generate")).status_code == 200:
                            del pending[url]
                    except httpx.HTTPError:
                        pass
                if pending:
                    if time.monotonic() > t_end:
                        raise EngineError(f"servers not ready after {deadline_s:.0f}s: {sorted(pending)}")
                    await asyncio.sleep(1.0)

    def stop(self, timeout_s: float = 30.0) -> None:
        stop_groups(self.procs, timeout_s)
        self.procs.clear()


def stop_groups(procs: Sequence[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM to each process group (started with ``start_new_session``), then SIGKILL to those still running
    after ``timeout_s`` in all."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    t_end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(0.1, t_end - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
