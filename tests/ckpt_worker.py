"""Subprocess for the checkpoint tests: `save DIR OUT` trains, saves, runs one more step, then SIGKILLs
itself; `restore DIR OUT [d,f,t]` restores (optionally onto a mesh) and runs that same next step."""

import hashlib
import json
import os
import signal
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from test_rl_step import CFG, params0, samples  # noqa: E402

from jaxrl_term.parallel.mesh import make_mesh  # noqa: E402
from jaxrl_term.rl.batch import make_batch  # noqa: E402
from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_train_step  # noqa: E402
from jaxrl_term.utils.checkpoint import Checkpointer  # noqa: E402


def digest(state):
    h = hashlib.sha256()
    for x in jax.tree.leaves(jax.device_get(state)):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def main(mode, ckpt_dir, out, mesh_shape=None):
    mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), map(int, mesh_shape.split(","))))) if mesh_shape else None
    ts = make_train_step(CFG, AlgoConfig(microbatches=2), OptimConfig(lr=1e-3), mesh)
    batches = [make_batch(samples(8, seed=s), buckets=(32,), row_multiple=8) for s in range(3)]
    ckpt = Checkpointer(ckpt_dir, max_to_keep=2)
    if mode == "save":
        state = ts.init_state(params0(), seed=5)
        for b in batches[:2]:
            state, _ = ts(state, b)
        ckpt.save(2, state, {"cursor": 17, "policy_version": 2})
        ckpt.wait()
    else:
        state, meta = ckpt.restore(ts.abstract_state())
        assert meta == {"cursor": 17, "policy_version": 2}, meta
    before = digest(state)
    state, metrics = ts(state, batches[2])
    params = {"/".join(str(k) for k in p): np.asarray(v).tolist()
              for p, v in jax.tree_util.tree_flatten_with_path(jax.device_get(state.params["layers"]["q_proj"]))[0]}
    with open(out, "w") as f:
        json.dump({"before": before, "after": digest(state), "loss": metrics["loss"], "q_proj": params,
                   "step": int(state.step)}, f)
    if mode == "save":
        os.kill(os.getpid(), signal.SIGKILL)  # die without any clean-up


if __name__ == "__main__":
    main(*sys.argv[1:])
