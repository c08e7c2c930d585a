"""The curriculum sampler (tasks/curriculum.py): it shifts training toward tasks whose recent pass rate is in
the band, its draws do not depend on the order groups finish in, and its saved state resumes to the same tasks."""

import json
import random
from types import SimpleNamespace

import pytest

from jaxrl_term.tasks.builtin import builtin_tasks
from jaxrl_term.tasks.curriculum import CurriculumSampler, CurriculumSettings, group_pass_rate

TASKS = builtin_tasks(2, difficulties=("easy",), split="train")  # 22 real tasks


def group(task, passes, n=4):
    trajs = [SimpleNamespace(reward_parts={"tests": 1.0 if k < passes else 0.0}) for k in range(n)]
    return SimpleNamespace(task=task, trajectories=trajs, rewards=[t.reward_parts["tests"] for t in trajs])


def true_rate(task):
    """A fixed 'policy': a third of the tasks always pass, a third never, a third half the time."""
    return [1.0, 0.0, 0.5][TASKS.index(task) % 3]


def simulate(sampler, start, stop, lookahead, rng_seed=0, shuffle_finish=False):
    """Drive the sampler like the pipeline does: group seq is drawn once the groups before seq - lookahead are
    consumed; groups are consumed in order. With ``shuffle_finish`` draws interleave with consumption at random."""
    drawn, consumed = {}, start
    order = random.Random(rng_seed)
    seq = start
    while consumed < stop:
        can_draw = seq < stop and sampler.ready(seq) and seq - consumed < lookahead
        if can_draw and (not shuffle_finish or order.random() < 0.5 or consumed == seq):
            drawn[seq] = sampler.task(seq)
            seq += 1
        else:
            t = drawn[consumed]
            sampler.observe(consumed, group(t, round(4 * true_rate(t))))
            consumed += 1
    return [drawn[s].id for s in range(start, stop)]


def test_sampling_shifts_toward_in_band_tasks():
    """After a warm-up, the tasks with pass rate 0.5 (a third of them) get most of the draws: weight 1 against
    0.1 for the always- and never-solved ones; a uniform sampler would give them a third."""
    s = CurriculumSampler(TASKS, seed=3, settings=CurriculumSettings((0.2, 0.8), 2, 0.1), lookahead=4)
    ids = simulate(s, 0, 1200, lookahead=4)
    late = ids[400:]
    in_band = sum(true_rate(next(t for t in TASKS if t.id == i)) == 0.5 for i in late) / len(late)
    n_in = sum(true_rate(t) == 0.5 for t in TASKS)
    expected = n_in / (n_in + 0.1 * (len(TASKS) - n_in))
    assert in_band > 0.6 and abs(in_band - expected) < 0.08, (in_band, expected)
    m = s.take_metrics()
    assert m["curriculum/tasks_seen"] == len(TASKS) and m["curriculum/tasks_in_band"] == n_in
    assert m["curriculum/sampled_in_band_frac"] > 0.6
    uniform = CurriculumSampler(TASKS, seed=3, settings=CurriculumSettings((0.0, 1.0), 2, 0.1), lookahead=4)
    ids = simulate(uniform, 0, 1200, lookahead=4)[400:]
    assert abs(sum(true_rate(next(t for t in TASKS if t.id == i)) == 0.5 for i in ids) / len(ids) - 1 / 3) < 0.06


def test_draws_do_not_depend_on_when_groups_finish():
    a = simulate(CurriculumSampler(TASKS, seed=1, lookahead=6), 0, 300, lookahead=6)
    b = simulate(CurriculumSampler(TASKS, seed=1, lookahead=6), 0, 300, lookahead=6, shuffle_finish=True, rng_seed=5)
    assert a == b
    assert a != simulate(CurriculumSampler(TASKS, seed=2, lookahead=6), 0, 300, lookahead=6)


def test_saved_state_resumes_to_the_same_next_tasks():
    """Kill at group 137 (state = the checkpoint's JSON), resume in a new sampler: the same next 200 tasks; the
    state stays small (compacted to what future draws can see)."""
    full = simulate(CurriculumSampler(TASKS, seed=7, lookahead=4), 0, 337, lookahead=4)
    first = CurriculumSampler(TASKS, seed=7, lookahead=4)
    simulate(first, 0, 137, lookahead=4)
    state = json.loads(json.dumps(first.state()))
    assert state["cursor"] == 137 and len(state["log"]) <= len(TASKS) * 4 + 4
    resumed = CurriculumSampler(TASKS, seed=7, lookahead=4, state=state)
    assert simulate(resumed, 137, 337, lookahead=4) == full[137:]
    fresh = CurriculumSampler(TASKS, seed=7, lookahead=4)
    fresh.cursor = 137  # no state: a different curriculum
    assert simulate(fresh, 137, 337, lookahead=4) != full[137:]


def test_misuse_is_refused():
    s = CurriculumSampler(TASKS, lookahead=2)
    with pytest.raises(RuntimeError, match="wait for ready"):
        s.task(5)
    with pytest.raises(RuntimeError, match="in order"):
        s.observe(1, None)
    s.observe(0, None)  # a dropped group advances the cursor, records nothing
    assert s.cursor == 1 and s.log == []
    assert group_pass_rate(SimpleNamespace(trajectories=[], rewards=[])) is None
    for bad in (dict(band=(0.9, 0.1)), dict(window=0), dict(out_of_band_weight=0.0)):
        with pytest.raises(ValueError, match="data.curriculum"):
            CurriculumSettings(**bad)
