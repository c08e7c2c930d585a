"""Spec -> teacher -> strict parse -> dedup / decontamination -> validation in real sandboxes -> kept or rejected.

Per spec (``jobs`` at once):

1. The teacher writes a task (``teacher.py``); a format error is sent back to it (a *repair*).
2. Cheap checks before any build: near-duplicate of a task already kept or in flight (MinHash of instruction
   word shingles, ``datasketch``'s LSH at ``dedup_threshold``) and contamination by an evaluation source (any
   word ``ngram``-gram of the instruction found in an evaluation task's instruction; n = 13 by default).
3. Validation with ``tasks check``'s own code, each phase in a fresh sandbox: ``nop`` (the image builds and the
   tests fail in the initial state: score 0) and ``oracle`` (the solution makes them pass: score 1). A build error,
   tests that pass initially, or an oracle that fails is sent back to the teacher with the evidence, up to
   ``max_repairs`` repairs per spec in all.
4. Kept: written as a Harbor task directory under ``out/harbor/``. Every spec ends in one line of
   ``out/records.jsonl``: ``kept`` or ``rejected`` with its reason (``format_error``, ``build_error``,
   ``passes_initially``, ``oracle_fails``, ``verifier_error``, ``near_duplicate``, ``contaminated``,
   ``out_of_band``), or ``error`` when the teacher could not be reached (infrastructure: never a rejection,
   retried by the next run). A run is resumable: specs with a kept / rejected record are skipped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from jaxrl_term.datagen.taxonomy import TaskSpec
from jaxrl_term.datagen.teacher import (
    REPAIR_BUILD,
    REPAIR_FORMAT,
    REPAIR_INITIAL,
    REPAIR_ORACLE,
    TeacherClient,
    TeacherFormatError,
    parse_task,
    render_messages,
)
from jaxrl_term.reward.judge import JudgeFailure
from jaxrl_term.tasks.task import Task

log = logging.getLogger(__name__)
REASONS = ("format_error", "build_error", "passes_initially", "oracle_fails", "verifier_error", "near_duplicate",
           "contaminated", "out_of_band")


@dataclasses.dataclass
class PipelineSettings:
    base_image: str = "jaxrl-term/base:trixie"
    jobs: int = 2
    max_repairs: int = 2
    dedup_threshold: float = 0.8
    num_perm: int = 128
    shingle: int = 5
    ngram: int = 13
    backend: str = "docker"
    scoring: str = "weighted"  # nop must score 0 under it: with weighted, no test may pass initially
    limits: dict | None = None
    agent_timeout_s: float = 600.0
    test_timeout_s: float = 120.0


def words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


class Deduper:
    """Near-duplicate instructions: MinHash (``num_perm`` permutations) over word ``shingle``-grams, LSH at
    Jaccard ``threshold``. ``claim`` registers an instruction; ``release`` forgets one (a rejected task)."""

    def __init__(self, threshold: float = 0.8, num_perm: int = 128, shingle: int = 5):
        from datasketch import MinHashLSH

        self.threshold, self.num_perm, self.shingle = threshold, num_perm, shingle
        self.lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self.keys: set[str] = set()

    def _minhash(self, text: str):
        from datasketch import MinHash

        w = words(text)
        n = self.shingle
        grams = {" ".join(w[i:i + n]) for i in range(max(1, len(w) - n + 1))}
        m = MinHash(num_perm=self.num_perm, seed=1)
        for g in grams:
            m.update(g.encode())
        return m

    def match(self, text: str) -> str | None:
        hits = self.lsh.query(self._minhash(text))
        return sorted(hits)[0] if hits else None

    def claim(self, key: str, text: str) -> None:
        if key not in self.keys:
            self.lsh.insert(key, self._minhash(text))
            self.keys.add(key)

    def release(self, key: str) -> None:
        if key in self.keys:
            self.lsh.remove(key)
            self.keys.discard(key)


class Decontaminator:
    """Word ``n``-gram overlap with evaluation tasks' instructions (an evaluation instruction shorter than n
    words counts as one n-gram: found inside a candidate, it is contamination too)."""

    def __init__(self, tasks: Sequence[Task], n: int = 13):
        self.n = n
        self.grams: dict[tuple[str, ...], str] = {}
        for t in tasks:
            w = words(t.instruction)
            for i in range(max(1, len(w) - n + 1)):
                self.grams.setdefault(tuple(w[i:i + n]), t.id)
        self.sources = len(tasks)
        self.short = [g for g in self.grams if len(g) < n]  # whole evaluation instructions shorter than n words

    def match(self, text: str) -> tuple[str, str] | None:
        w = words(text)
        short = self.short
        for i in range(max(1, len(w) - self.n + 1)):
            g = tuple(w[i:i + self.n])
            if g in self.grams:
                return self.grams[g], " ".join(g)
        for g in short:  # whole short evaluation instructions inside the candidate
            k = len(g)
            if any(tuple(w[i:i + k]) == g for i in range(len(w) - k + 1)):
                return self.grams[g], " ".join(g)
        return None

    @classmethod
    def from_sources(cls, sources: Sequence[str], n: int = 13) -> Decontaminator:
        from jaxrl_term.tasks.dataset import load_dataset

        tasks: list[Task] = []
        for src in sources:
            if src.startswith("builtin"):
                split = src.split(":", 1)[1] if ":" in src else "heldout"
                tasks += load_dataset("builtin", split=split, n_per_cell=8)
            else:
                tasks += load_dataset(src)
        return cls(tasks, n)


@dataclasses.dataclass
class Outcome:
    spec_id: str
    status: str  # kept | rejected | error
    reason: str = ""
    detail: str = ""
    calls: int = 0
    repairs: int = 0
    endpoint: str | None = None
    seconds: float = 0.0
    task_id: str | None = None
    pass_rate: float | None = None
    spec: dict = dataclasses.field(default_factory=dict)


Check = Callable[[Task, str], Any]  # (task, "nop" | "oracle") -> awaitable CheckResult


class Pipeline:
    def __init__(self, teacher: TeacherClient, out_dir: str | Path, settings: PipelineSettings | None = None, *,
                 decontaminator: Decontaminator | None = None, builder=None, check: Check | None = None,
                 pass_rate: Callable[[Sequence[Task]], Any] | None = None,
                 band: tuple[float, float] = (0.0, 1.0)):
        self.teacher, self.s = teacher, settings or PipelineSettings()
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.records_path = self.out / "records.jsonl"
        self.harbor = self.out / "harbor"
        self.dedup = Deduper(self.s.dedup_threshold, self.s.num_perm, self.s.shingle)
        self.decontam = decontaminator
        self.builder = builder
        self._check = check
        self.pass_rate, self.band = pass_rate, band
        self.done: dict[str, dict] = {}
        self._pending: dict[str, Task] = {}  # validated, not yet written (waiting for the pass-rate band)
        self._load_previous()

    def _load_previous(self) -> None:
        """Resume: kept / rejected specs are done; the kept tasks re-enter the dedup index."""
        if self.records_path.exists():
            for i, line in enumerate(self.records_path.read_text().splitlines()):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("%s:%d: unreadable record (a run killed mid-write?), that spec is redone",
                                self.records_path, i + 1)
                    continue
                if rec.get("status") in ("kept", "rejected"):
                    self.done[rec["spec_id"]] = rec
        if self.harbor.is_dir():
            from jaxrl_term.tasks.formats import load_tasks

            for t in load_tasks(self.harbor, skip_bad=True):
                if t.id in self.done and self.done[t.id].get("status") == "kept":
                    self.dedup.claim(t.id, t.instruction)

    def _record(self, o: Outcome) -> None:
        with self.records_path.open("a") as f:
            f.write(json.dumps(dataclasses.asdict(o)) + "\n")
            f.flush()
        if o.status in ("kept", "rejected"):
            self.done[o.spec_id] = dataclasses.asdict(o)

    async def check(self, task: Task, agent: str):
        if self._check is not None:
            return await self._check(task, agent)
        from jaxrl_term.tasks.check import check_task

        return await check_task(task, agent, backend=self.s.backend, builder=self.builder, scoring=self.s.scoring,
                                limits=self.s.limits)

    async def run(self, specs: Sequence[TaskSpec], progress: Callable[[Outcome], None] | None = None
                  ) -> list[Outcome]:
        todo = [s for s in specs if s.spec_id not in self.done]
        if self.builder is None and self._check is None and self.s.backend == "docker":
            from jaxrl_term.sandbox.images import ImageBuilder

            self.builder = ImageBuilder()
        sem = asyncio.Semaphore(max(1, self.s.jobs))
        results: list[Outcome] = []

        async def one(spec: TaskSpec) -> None:
            async with sem:
                o = await self.one(spec)
            if o.status == "kept" and self.pass_rate is None:
                self._keep_files(o)
            if self.pass_rate is None or o.status != "kept":
                self._record(o)
            results.append(o)
            if progress:
                progress(o)

        await asyncio.gather(*(one(s) for s in todo))
        if self.pass_rate is not None:
            await self._band([o for o in results if o.status == "kept"], progress)
        return results

    async def _band(self, kept: list[Outcome], progress) -> None:
        """Policy rollouts on the validated tasks: keep those whose pass rate is inside the band."""
        if kept:
            rates = await self.pass_rate([self._pending[o.spec_id] for o in kept])
            for o in kept:
                o.pass_rate = rates.get(o.task_id)
                lo, hi = self.band
                if o.pass_rate is None or not lo <= o.pass_rate <= hi:
                    o.status, o.reason = "rejected", "out_of_band"
                    o.detail = f"pass rate {o.pass_rate} outside [{lo}, {hi}]"
                    self.dedup.release(o.task_id)
                    self._pending.pop(o.spec_id, None)
                else:
                    self._keep_files(o)
                self._record(o)

    def _keep_files(self, o: Outcome) -> None:
        from jaxrl_term.tasks.formats import export_harbor

        export_harbor([self._pending.pop(o.spec_id)], self.harbor)

    async def one(self, spec: TaskSpec) -> Outcome:
        t0 = time.monotonic()
        requests = [0]
        o = Outcome(spec.spec_id, "rejected", spec=spec.to_json())
        messages = render_messages(spec, self.s.base_image)
        for attempt in range(self.s.max_repairs + 1):
            o.repairs = attempt
            try:
                text, o.endpoint = await self.teacher.chat(messages, requests=requests)
            except JudgeFailure as f:
                o.status, o.reason, o.detail = "error", f"teacher_{f.kind}", str(f)[:500]
                break
            finally:
                o.calls = requests[0]
            messages = [*messages, {"role": "assistant", "content": text}]
            try:
                parsed = parse_task(text, self.s.base_image)
            except TeacherFormatError as e:
                o.reason, o.detail = "format_error", str(e)
                messages.append({"role": "user", "content": REPAIR_FORMAT.format(error=e)})
                continue
            task = parsed.to_task(spec.spec_id, spec, agent_timeout_s=self.s.agent_timeout_s,
                                  test_timeout_s=self.s.test_timeout_s)
            self.dedup.release(spec.spec_id)  # a repaired task replaces its own earlier version
            dup = self.dedup.match(task.instruction)
            if dup is not None:
                o.reason, o.detail = "near_duplicate", f"instruction near-duplicates {dup}"
                break
            if self.decontam is not None:
                hit = self.decontam.match(task.instruction)
                if hit is not None:
                    o.reason, o.detail = "contaminated", f"{self.decontam.n}-gram shared with {hit[0]}: {hit[1]!r}"
                    break
            self.dedup.claim(spec.spec_id, task.instruction)
            nop = await self.check(task, "nop")
            if nop.outcome == "build_error":
                o.reason, o.detail = "build_error", nop.reason[-2000:]
                messages.append({"role": "user", "content": REPAIR_BUILD.format(error=nop.reason[-2000:])})
                continue
            if nop.outcome != "scored":
                o.reason, o.detail = "verifier_error", f"nop: {nop.reason}"[:2000]
                messages.append({"role": "user", "content": REPAIR_ORACLE.format(
                    error=f"the tests could not run in the initial state: {nop.reason}"[:2000])})
                continue
            if nop.score:
                passing = sorted(n for n, ok in nop.passed.items() if ok) or ["(the test file as a whole)"]
                o.reason, o.detail = "passes_initially", f"nop scored {nop.score:.3f}; passing: {passing}"
                messages.append({"role": "user", "content": REPAIR_INITIAL.format(tests=", ".join(passing))})
                continue
            orc = await self.check(task, "oracle")
            if orc.outcome == "scored" and orc.score == 1.0:
                o.status, o.reason, o.detail, o.task_id = "kept", "", "", task.id
                self._pending[spec.spec_id] = task
                break
            if orc.outcome == "build_error":
                o.reason = "build_error"
            elif orc.outcome == "scored":
                o.reason = "oracle_fails"
            else:
                o.reason = "verifier_error"
            o.detail = f"oracle: {orc.reason}"[:2000]
            messages.append({"role": "user", "content": REPAIR_ORACLE.format(error=orc.reason[:2000])})
        if o.status != "kept":
            self.dedup.release(spec.spec_id)
        o.seconds = round(time.monotonic() - t0, 2)
        return o


def read_records(out_dir: str | Path) -> list[dict]:
    """The last record per spec (an ``error`` followed by a later result counts as the result)."""
    p = Path(out_dir) / "records.jsonl"
    last: dict[str, dict] = {}
    if p.exists():
        for line in p.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            last[rec["spec_id"]] = rec
    return list(last.values())
