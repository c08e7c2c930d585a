"""``python -m jaxrl_term.datagen run``: the pipeline from a composed config, with progress, export and report."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import OmegaConf

from jaxrl_term.datagen.pipeline import Decontaminator, Pipeline, PipelineSettings, read_records
from jaxrl_term.datagen.report import summarize, write_report
from jaxrl_term.datagen.taxonomy import TaskSpec, load_taxonomy
from jaxrl_term.datagen.teacher import TeacherClient
from jaxrl_term.reward.judge import endpoints_from_config

log = logging.getLogger(__name__)


def teacher_from_config(t) -> TeacherClient:
    return TeacherClient(endpoints_from_config(OmegaConf.to_container(t.endpoints)),
                         failure_threshold=t.failure_threshold, cooldown_s=t.cooldown_s, rounds=t.rounds,
                         backoff_s=t.backoff_s, cache_size=t.cache_size, retries=t.retries,
                         max_retry_after_s=t.max_retry_after_s)


def load_specs(d) -> tuple[list[TaskSpec], dict | None]:
    """The specs of this run and the target shares they were drawn for (None for a specs file)."""
    tax = load_taxonomy(d.taxonomy)
    if d.specs:
        specs = [TaskSpec.from_json(json.loads(line), where=f"{d.specs}:{i + 1}")
                 for i, line in enumerate(Path(d.specs).read_text().splitlines()) if line.strip()]
        return specs, None
    return tax.sample(d.n, d.seed, mix=d.mix, corpus=d.corpus), tax.expected_shares(d.mix, d.corpus)


def eval_pass_rates(out: Path, attempts: int, overrides: list[str]):
    """A pass-rate function for the band: the candidates as Harbor dirs, ``jaxrl_term.eval`` on them."""

    async def rates(tasks) -> dict[str, float | None]:
        from jaxrl_term.eval.__main__ import compose
        from jaxrl_term.eval.run import run_eval
        from jaxrl_term.tasks.formats import export_harbor

        cand = out / "candidates"
        export_harbor(tasks, cand)
        cfg = compose([f"data.source={cand}", "data.difficulties=null", f"eval.attempts={attempts}",
                       f"run_dir={out / 'pass_rate'}", *overrides])
        summary = await run_eval(cfg)
        return {tid: v.get("pass@1") for tid, v in summary["per_task"].items()}

    return rates


async def run_datagen(cfg, *, builder=None, check=None) -> dict:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from jaxrl_term.train import sandbox_backend

    d = cfg.datagen
    out = Path(d.out_dir)
    specs, targets = load_specs(d)
    backend = "docker"
    if check is None and builder is None:
        backend, builder = sandbox_backend(cfg.sandbox)
    settings = PipelineSettings(base_image=d.base_image, jobs=d.jobs, max_repairs=d.max_repairs,
                                dedup_threshold=d.dedup_threshold, ngram=d.ngram, backend=backend,
                                scoring=d.scoring, limits=OmegaConf.to_object(cfg.sandbox).limits())
    decon = Decontaminator.from_sources(list(d.decontaminate), d.ngram) if d.decontaminate else None
    teacher = teacher_from_config(d.teacher)
    pr = d.pass_rate
    pipe = Pipeline(teacher, out, settings, decontaminator=decon, builder=builder, check=check,
                    pass_rate=eval_pass_rates(out, pr.attempts, list(pr.eval_overrides)) if pr.enabled else None,
                    band=tuple(pr.band))
    left = [s for s in specs if s.spec_id not in pipe.done]
    log.info("%d specs, %d already done in %s; %d to go", len(specs), len(specs) - len(left), out, len(left))
    counts = {"kept": 0, "rejected": 0, "error": 0, "validated": 0}
    with Progress(TextColumn("datagen"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn()) as bar:
        job = bar.add_task("", total=len(left))

        def tick(o) -> None:
            status = "validated" if (o.status == "kept" and pr.enabled) else o.status  # the band comes later
            counts[status] += 1
            bar.update(job, advance=1, description=f"kept {counts['kept']} validated {counts['validated']} "
                                                   f"rejected {counts['rejected']} errors {counts['error']}")
            log.info("%s: %s %s %s", o.spec_id, o.status, o.reason, o.detail[:200])

        try:
            await pipe.run(specs, progress=tick)
        finally:
            await teacher.aclose()
    kept_dir = out / "harbor"
    if kept_dir.is_dir():
        from jaxrl_term.tasks.formats import load_tasks, save_parquet

        kept_ids = {r["task_id"] for r in read_records(out) if r["status"] == "kept"}
        tasks = [t for t in load_tasks(kept_dir, skip_bad=True) if t.id in kept_ids]
        if tasks:
            save_parquet(tasks, out / "tasks.parquet")
    write_report(out, targets)
    return summarize(read_records(out))
