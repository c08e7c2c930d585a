"""Orbax checkpoints: save -> SIGKILL -> restore gives a bit-identical next step; restore onto another mesh."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("ckpt_worker.py")


def run(*args):
    proc = subprocess.run([sys.executable, str(WORKER), *map(str, args)], capture_output=True, text=True, timeout=600)
    return proc


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    proc = run("save", d / "ckpt", d / "a.json")
    assert proc.returncode == -9, proc.stderr[-3000:]  # it really was killed
    return d


def test_restore_after_kill_gives_a_bit_identical_next_step(saved):
    proc = run("restore", saved / "ckpt", saved / "b.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = json.loads((saved / "a.json").read_text()), json.loads((saved / "b.json").read_text())
    assert a["before"] == b["before"]  # the restored state is the saved state, bit for bit
    assert a["after"] == b["after"]  # and the next step is too
    assert a["loss"] == b["loss"] and b["step"] == 3


def test_restore_onto_a_different_mesh(saved):
    proc = run("restore", saved / "ckpt", saved / "c.json", "2,2,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, c = json.loads((saved / "a.json").read_text()), json.loads((saved / "c.json").read_text())
    assert c["loss"] == pytest.approx(a["loss"], rel=1e-5)
    for k in a["q_proj"]:
        np.testing.assert_allclose(np.asarray(c["q_proj"][k]), np.asarray(a["q_proj"][k]), rtol=1e-4, atol=1e-6)


def test_keeps_only_the_last_n(tmp_path):
    import jax.numpy as jnp

    from jaxrl_term.utils.checkpoint import Checkpointer, abstract_like

    with Checkpointer(tmp_path, max_to_keep=2) as ck:
        for s in range(1, 5):
            ck.save(s, {"w": jnp.full((4,), float(s))}, {"s": s})
        ck.wait()
        assert ck.all_steps() == [3, 4]
        state, meta = ck.restore(abstract_like({"w": jnp.zeros((4,))}))
        assert meta == {"s": 4} and float(state["w"][0]) == 4.0
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Checkpointer(tmp_path / "empty").restore({"w": None})
