"""The training / evaluation task set from the ``data`` config group: a source plus filters."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

from jaxrl_term.tasks.task import Task

log = logging.getLogger(__name__)


def load_dataset(
    source: str,
    *,
    split: str = "train",
    n_per_cell: int = 4,
    families: Sequence[str] | None = None,
    difficulties: Sequence[str] | None = None,
    ids: Sequence[str] | None = None,
    exclude_ids: Sequence[str] | None = None,
    limit: int | None = None,
    skip_bad: bool = True,
    seed: int = 0,
) -> list[Task]:
    """``source``: ``builtin`` (``n_per_cell`` instances per family x difficulty from ``split``; a cell with
    none in ``split``, all its instructions in the other, is skipped with a warning), or anything
    ``load_tasks`` reads. Filters apply in order (difficulties, ids, exclusions); ``limit`` keeps a seeded
    random subset. Bad tasks are skipped with a warning when ``skip_bad``."""
    if source == "builtin":
        from jaxrl_term.tasks.builtin import DIFFICULTIES, builtin_tasks

        tasks = builtin_tasks(n_per_cell, families=list(families) if families else None,
                              difficulties=tuple(difficulties or DIFFICULTIES), split=split, seed=seed)
    else:
        from jaxrl_term.tasks.formats import load_tasks

        errors: list[str] = []
        tasks = load_tasks(source, skip_bad=skip_bad, errors=errors)
        if errors:
            log.warning("%s: skipped %d bad task(s)", source, len(errors))
        if difficulties:
            tasks = [t for t in tasks if t.difficulty in set(difficulties)]
    if ids:
        want = set(ids)
        tasks = [t for t in tasks if t.id in want]
    if exclude_ids:
        drop = set(exclude_ids)
        tasks = [t for t in tasks if t.id not in drop]
    if limit is not None and len(tasks) > limit:
        tasks = sorted(random.Random(seed).sample(tasks, limit), key=lambda t: t.id)
    if not tasks:
        raise ValueError(f"data: no tasks left from {source!r} after filtering")
    return tasks


def load_from_config(data) -> list[Task]:
    """The tasks of a ``data`` config node (``DataCfg``): its source and filters. ``curriculum`` is not a filter
    (it decides the order of training, tasks/curriculum.py) and is left to the trainer."""
    from omegaconf import OmegaConf

    d = OmegaConf.to_container(data) if not isinstance(data, dict) else dict(data)
    d.pop("curriculum", None)
    return load_dataset(d.pop("source"), **d)
