"""One task schema for every source format (Terminal-Bench 1, Harbor / TB2, the TB-RL CSV, our Parquet)."""

from __future__ import annotations

import dataclasses
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

    def __post_init__(self):
        if not self.dockerfile and not self.image:
            raise TaskFormatError("environment: needs a Dockerfile or an image")


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

    __hash__ = None  # holds dicts; compare with ==

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
