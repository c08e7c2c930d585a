"""One task schema for every source format (Terminal-Bench 1, Harbor / TB2, the TB-RL CSV, our Parquet)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any


class TaskFormatError(ValueError):
    """A task that cannot be loaded; the message names the file (or CSV row) and the field."""


@dataclasses.dataclass(frozen=True)
class FileBlob:
    data: bytes
    mode: int = 0o644

    @classmethod
    def text(cls, s: str, mode: int = 0o644) -> FileBlob:
        return cls(s.encode(), mode)


Files = Mapping[str, FileBlob]  # relative path -> content

NETWORK_MODES = ("public", "no-network", "allowlist")  # Harbor's NetworkMode values


@dataclasses.dataclass(frozen=True)
class NetworkPolicy:
    """What a phase (agent, verifier) may reach: ``public`` (the sandbox's public network), ``no-network``
    (loopback, plus the task's own compose services), ``allowlist`` (Harbor's; refused by our sandboxes)."""

    mode: str = "public"
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self):
        if self.mode not in NETWORK_MODES:
            raise TaskFormatError(f"network_mode={self.mode!r}; use one of {NETWORK_MODES}")
        if self.allowed_hosts and self.mode != "allowlist":
            raise TaskFormatError("allowed_hosts is only valid with network_mode = 'allowlist'")

    @property
    def online(self) -> bool:
        return self.mode != "no-network"


PUBLIC, NO_NETWORK = NetworkPolicy("public"), NetworkPolicy("no-network")


@dataclasses.dataclass(frozen=True)
class Healthcheck:
    """Harbor's ``[environment.healthcheck]``: a command run in the sandbox after it starts, until it exits 0,
    before the agent starts (Docker HEALTHCHECK semantics)."""

    command: str
    interval_s: float = 5.0
    timeout_s: float = 30.0
    start_period_s: float = 0.0
    start_interval_s: float = 5.0
    retries: int = 3


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where the agent works: a Dockerfile with its build context, or a prebuilt image."""

    dockerfile: str | None = None
    files: Files = dataclasses.field(default_factory=dict)  # build context (besides the Dockerfile)
    image: str | None = None
    workdir: str = "/app"
    cpus: float | None = None
    memory_mb: int | None = None
    allow_internet: bool = False
    build_timeout_s: float = 1800.0
    # Harbor's [environment] beyond the basics (tasks/formats.py maps every field of its task model)
    network: NetworkPolicy | None = None  # explicit network_mode; None: from allow_internet
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)  # values may be ${VAR} / ${VAR:-default}
    storage_mb: int | None = None
    compose: str | None = None  # docker-compose.yaml: services beside the agent's (sandbox/compose.py)
    healthcheck: Healthcheck | None = None

    def __post_init__(self):
        if not self.dockerfile and not self.image:
            raise TaskFormatError("environment: needs a Dockerfile or an image")

    @property
    def baseline(self) -> NetworkPolicy:
        """The network every phase has unless it says otherwise (Harbor's ``resolve_baseline``)."""
        if self.network is not None:
            return self.network
        return PUBLIC if self.allow_internet else NO_NETWORK


RUNNERS = ("pytest", "run-tests.sh", "harbor")


@dataclasses.dataclass(frozen=True)
class Tests:
    """The task's own tests, copied into /tests after the agent is done.

    runner: ``pytest`` (``entry`` is a pytest file, results via JUnit XML), ``run-tests.sh`` (TB1: the script
    runs pytest; results via JUnit XML through PYTEST_ADDOPTS), ``harbor`` (``tests/test.sh`` writes
    ``/logs/verifier/reward.json|txt``). ``weights``: test name -> weight (TB-RL); empty = equal weights.
    """

    runner: str
    files: Files
    entry: str
    weights: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.runner not in RUNNERS:
            raise TaskFormatError(f"tests.runner={self.runner!r}; use one of {RUNNERS}")
        if self.entry not in self.files:
            raise TaskFormatError(f"tests: entry {self.entry!r} is not among the test files {sorted(self.files)}")


@dataclasses.dataclass(frozen=True)
class Solution:
    """An oracle: files copied to /solution, then ``bash /solution/<entry>`` in the work dir."""

    files: Files
    entry: str


@dataclasses.dataclass(frozen=True)
class Task:
    id: str
    instruction: str
    environment: Environment
    tests: Tests
    solution: Solution | None = None
    agent_timeout_s: float = 600.0
    test_timeout_s: float = 120.0
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # difficulty, category, tags, source
    # Shell commands that start the services the tests talk to. The verifier kills every process the agent left
    # running, then starts these (from the task's definition, not inherited from the agent) before the tests.
    services: tuple[str, ...] = ()
    # Harbor's per-phase network overrides ([agent] / [verifier] network_mode) and phase environments
    agent_network: NetworkPolicy | None = None
    verifier_network: NetworkPolicy | None = None
    verifier_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    solution_env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    __hash__ = None  # holds dicts; compare with ==

    def phase_network(self, phase: str) -> NetworkPolicy:
        """The task's own policy for ``phase`` (``agent`` or ``verifier``): the phase's override, else the
        environment's baseline."""
        own = {"agent": self.agent_network, "verifier": self.verifier_network}[phase]
        return own or self.environment.baseline

    @property
    def difficulty(self) -> str | None:
        return self.metadata.get("difficulty")

    @property
    def category(self) -> str | None:
        return self.metadata.get("category")

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self.metadata.get("tags", ()))

    @property
    def source(self) -> str | None:
        return self.metadata.get("source")


_TEMPLATE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-(.*?))?\}")


def resolve_env(env: Mapping[str, str], where: str, host: Mapping[str, str] | None = None) -> dict[str, str]:
    """Harbor's environment templates: ``${VAR}`` and ``${VAR:-default}`` from the host's environment, at run
    time (secrets stay out of task files); a variable that is unset and has no default is an error naming it."""
    host = os.environ if host is None else host
    out = {}
    for key, value in env.items():
        def sub(m: re.Match) -> str:
            if m.group(1) in host:
                return host[m.group(1)]
            if m.group(2) is not None:
                return m.group(2)
            raise TaskFormatError(f"{where}: env {key} = {value!r} needs ${{{m.group(1)}}}, which is not set in "
                                  f"this process's environment; export it or write ${{{m.group(1)}:-default}}")
        out[key] = _TEMPLATE.sub(sub, value)
    return out
