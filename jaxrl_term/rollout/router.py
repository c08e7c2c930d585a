"""``sglang-router`` in front of every SGLang server: one process, started by trainer process 0.

The router (PyPI ``sglang-router``, a Rust binary behind ``python -m sglang_router.launch_router``; read in
sgl-model-gateway 0.3.2) proxies ``/generate`` to one worker chosen by its ``--policy``. ``manual`` keeps a
request that carries the header ``X-SMG-Routing-Key`` on the worker that key was first given to (new keys go
to the worker chosen by ``--assignment-mode``: ``random``, the router's default; ``min_load``, ours: fewest
requests in flight; or ``min_group``: fewest keys in flight); the key moves only when that worker is unhealthy or its circuit breaker
is open. The client sends the episode id as the key, so an episode's turns reuse one server's prefix cache.
``cache_aware`` instead matches the request text (input ids joined by spaces) against a tree of what each
worker saw, and sends a request to the least loaded worker whenever the load is unbalanced: an episode may move.

Dead workers. A request that fails with a connection error or a 5xx is retried (``--retry-max-retries`` 5,
backoff from 50 ms) on a freshly selected worker; ``--cb-failure-threshold`` (10) failures in a row open the
worker's circuit breaker (no traffic until ``--cb-timeout-duration-secs``, 60 s), and a background probe of
``--health-check-endpoint`` every ``--health-check-interval-secs`` marks it unhealthy after
``--health-failure-threshold`` failures and healthy again after ``--health-success-threshold`` successes. The
probe here is ``/v1/models``, not SGLang's ``/health``: that one runs a one-token generation, which waits while
a weight sync pauses the server (SGLang answers 503 after 20 s), and would take every server out of the pool
during each sync. ``/readiness`` answers 200 with ``healthy_workers`` once any worker is healthy.

What the router does not do for us: it has no ``/pause_generation``, ``/continue_generation``,
``/update_weights_from_disk`` or memory-saver routes, ``/get_server_info`` and ``/model_info`` answer from one
worker, and a batched ``/generate`` (a list of sampling params) is refused (422). The client therefore sends
weight sync, pause/continue, flush, memory release/resume, limits and batched requests to every (or one)
worker URL itself, and only single ``/generate`` requests through the router.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from jaxrl_term.rollout.engine import EngineError
from jaxrl_term.rollout.launcher import die_with_parent, stop_groups

log = logging.getLogger(__name__)
POLICIES = ("manual", "cache_aware", "round_robin", "random", "power_of_two")  # sglang-router 0.3.2's --policy
STICKY_POLICIES = ("manual", "cache_aware")  # the ones that keep an episode on the server holding its prefix
ASSIGNMENT_MODES = ("random", "min_load", "min_group")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class SGLangRouter:
    """One ``python -m sglang_router.launch_router`` process in front of ``worker_urls``.

    ``start()`` launches it (log: ``log_dir/router.log``; it gets SIGKILL when the thread that started it dies),
    ``wait_ready()`` waits until it reports every worker healthy, ``stop()`` ends it (SIGTERM, then SIGKILL).
    ``port``/``prometheus_port`` None: free ports on ``host``."""

    def __init__(self, worker_urls: Sequence[str], *, python: str | None = None,
                 module: str = "sglang_router.launch_router", host: str = "127.0.0.1", port: int | None = None,
                 policy: str = "manual", assignment_mode: str = "min_load", health_check_endpoint: str = "/v1/models",
                 health_check_interval_s: int = 10, health_failure_threshold: int = 3,
                 request_timeout_s: float = 3600.0, startup_timeout_s: float = 900.0,
                 prometheus_port: int | None = None, log_level: str = "warn", extra_args: Sequence[str] = (),
                 log_dir: str = "runs/sglang"):
        if not worker_urls:
            raise ValueError("sglang-router needs at least one worker URL")
        if policy not in POLICIES:
            raise ValueError(f"rollout.sglang.router_launch.policy={policy!r}; sglang-router knows {list(POLICIES)}")
        if assignment_mode not in ASSIGNMENT_MODES:
            raise ValueError(f"rollout.sglang.router_launch.assignment_mode={assignment_mode!r}; use one of "
                             f"{list(ASSIGNMENT_MODES)}")
        if policy not in STICKY_POLICIES:
            log.warning("sglang-router policy %s does not keep an episode on one server: every turn may prefill "
                        "its whole context again (use manual or cache_aware)", policy)
        self.worker_urls = [u.rstrip("/") for u in worker_urls]
        self.python, self.module, self.host = python or sys.executable, module, host
        self.port = port or free_port(host)
        self.prometheus_port = prometheus_port or free_port(host)
        self.policy, self.assignment_mode = policy, assignment_mode
        self.health_check_endpoint, self.health_check_interval_s = health_check_endpoint, health_check_interval_s
        self.health_failure_threshold, self.request_timeout_s = health_failure_threshold, request_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.log_level, self.extra = log_level, list(extra_args)
        self.log_path = Path(log_dir) / "router.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        h = "127.0.0.1" if self.host in ("0.0.0.0", "") else "::1" if self.host == "::" else self.host
        return f"http://[{h}]:{self.port}" if ":" in h else f"http://{h}:{self.port}"

    def command(self) -> list[str]:
        return [self.python, "-m", self.module, "--worker-urls", *self.worker_urls, "--host", self.host,
                "--port", str(self.port), "--policy", self.policy, "--assignment-mode", self.assignment_mode,
                "--health-check-endpoint", self.health_check_endpoint,
                "--health-check-interval-secs", str(self.health_check_interval_s),
                "--health-failure-threshold", str(self.health_failure_threshold),
                "--request-timeout-secs", str(max(1, int(self.request_timeout_s))),
                # the servers are usually up when the router starts: check them every second, not every 30 s
                "--worker-startup-timeout-secs", str(max(1, int(self.startup_timeout_s))),
                "--worker-startup-check-interval", "1",
                "--shutdown-grace-period-secs", "5",  # stop() comes after the last request
                "--prometheus-host", self.host if self.host not in ("0.0.0.0", "::", "") else "127.0.0.1",
                "--prometheus-port", str(self.prometheus_port), "--log-level", self.log_level, *self.extra]

    def start(self) -> str:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen([*die_with_parent(), *self.command()], stdout=logf,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        log.info("sglang-router (%s policy) on %s in front of %d server(s); log %s", self.policy, self.url,
                 len(self.worker_urls), self.log_path)
        return self.url

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    async def wait_ready(self, deadline_s: float = 300.0) -> None:
        """Until ``/readiness`` reports every worker healthy; raise if the router exits or the time runs out."""
        await wait_router_ready(self.url, len(self.worker_urls), deadline_s, proc=self)

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float = 15.0) -> None:
        p, self.proc = self.proc, None
        if p is not None:
            stop_groups([p], timeout_s)


async def wait_router_ready(url: str, n_workers: int, deadline_s: float, proc: SGLangRouter | None = None) -> None:
    """Poll the router's ``/readiness`` until ``healthy_workers >= n_workers``."""
    t_end = time.monotonic() + deadline_s
    last = "no answer"
    async with httpx.AsyncClient(timeout=10) as c:
        while True:
            if proc is not None and proc.exited() is not None:
                raise EngineError(f"sglang-router {url} exited with code {proc.exited()}:\n{proc._tail()}",
                                  retryable=False)
            try:
                r = await c.get(url + "/readiness")
                info = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
                if int(info.get("healthy_workers", 0)) >= n_workers:
                    return
                last = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > t_end:
                raise EngineError(f"sglang-router {url} does not report {n_workers} healthy worker(s) after "
                                  f"{deadline_s:.0f}s (last /readiness: {last})", retryable=False)
            await asyncio.sleep(0.25)
