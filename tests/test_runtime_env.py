"""Environment before backend (runtime_env.py): every entry point sets what JAX/XLA/NCCL read at client creation
before anything creates a backend, and the values reach the client."""

import json
import os
import subprocess
import sys

import pytest

from jaxrl_term.runtime_env import BackendStartedError, apply_env, backend_exists, changes, merge_xla_flags
from tests.conftest import REPO

# Runs an entry point as `python -m MODULE ARGS` with runtime_env.apply_env wrapped: the wrapper records whether a
# backend existed when it was called, applies the environment, creates the backend itself (jax.device_count), and
# records what the client saw, then exits. An entry point that never calls apply_env writes nothing (a failure);
# one that touched a backend first records backend_before=true.
PROBE = r"""
import json, os, runpy, sys
import jaxrl_term.runtime_env as rt
out, module, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
real = rt.apply_env
def probe(env, *, who, override=False):
    before = rt.backend_exists()
    try:
        done = real(env, who=who, override=override)
    except rt.BackendStartedError as e:
        with open(out, "w") as f:
            json.dump({"who": who, "backend_before": before, "error": str(e)}, f)
        os._exit(0)
    import jax
    rec = {"who": who, "backend_before": before, "set": done, "devices": jax.device_count(),
           "platforms": jax.config.values.get("jax_platforms"), "prng": jax.config.values.get("jax_default_prng_impl"),
           "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION", "NCCL_DEBUG",
                                                  "JAX_PLATFORMS")}}
    with open(out, "w") as f:
        json.dump(rec, f)
    os._exit(0)
rt.apply_env = probe
sys.argv = [module, *argv]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""

THREE = "'--xla_force_host_platform_device_count=3'"
ENTRY_POINTS = {
    # module, arguments; the config asks for 3 CPU devices through trainer.cluster.env
    # JAX_* are read at `import jax` (before apply_env): they must reach jax.config all the same
    "train": ("jaxrl_term.train", ["+experiment=tiny_cpu", f"+trainer.cluster.env.XLA_FLAGS={THREE}",
                                   "+trainer.cluster.env.JAX_DEFAULT_PRNG_IMPL=rbg",
                                   "+trainer.cluster.env.NCCL_DEBUG=WARN", "trainer.warm_start.enabled=false"]),
    "sft": ("jaxrl_term.sft", [f"+trainer.cluster.env.XLA_FLAGS={THREE}", "+trainer.cluster.env.NCCL_DEBUG=WARN",
                               "sft.steps=1"]),
    "eval": ("jaxrl_term.eval", ["policy=nop", f"+trainer.cluster.env.XLA_FLAGS={THREE}",
                                 "+trainer.cluster.env.NCCL_DEBUG=WARN"]),
    # the planner fakes the preset's devices: mesh fsdp 3 -> 3 devices
    "plan": ("jaxrl_term.plan", ["+experiment=tiny_cpu", "mesh.shape.fsdp=3", "mesh.shape.data=1", "--no-flops"]),
    # serve: --mem-fraction-static is XLA's preallocation share; the model dir is read only after the backend
    "serve": ("jaxrl_term.serve", ["--model-dir", "/nonexistent", "--mem-fraction-static", "0.42"]),
}


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """Every entry point under the probe, started together (each is mostly import time)."""
    tmp = tmp_path_factory.mktemp("envprobe")
    # no JAX_PLATFORMS: the planner must force CPU itself (on a GPU node it would otherwise plan on the GPUs)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                                            "NCCL_DEBUG", "JAX_PLATFORMS")}
    procs = {}
    for name, (module, args) in ENTRY_POINTS.items():
        out = tmp / f"{name}.json"
        argv = [sys.executable, "-c", PROBE, str(out), module, *args]
        if name in ("train", "sft", "eval"):
            argv.append(f"run_dir={tmp / name}")
        procs[name] = (out, subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                             stderr=subprocess.STDOUT, text=True))
    res = {}
    for name, (out, p) in procs.items():
        try:
            log = p.communicate(timeout=240)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            log = p.communicate()[0]
        res[name] = (json.loads(out.read_text()) if out.exists() else None, p.returncode, log)
    return res


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_entry_point_sets_the_backend_environment_before_any_backend_exists(probes, name):
    rec, rc, log = probes[name]
    assert rec is not None, f"{name} never called runtime_env.apply_env (exit {rc}):\n{log[-3000:]}"
    assert rec["backend_before"] is False, f"{name} created a JAX backend before applying its environment"
    if name == "serve":
        assert rec["env"]["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.42"
    else:
        assert rec["devices"] == 3, f"{name}: the client saw {rec['devices']} devices, not the 3 asked for"
        assert "--xla_force_host_platform_device_count=3" in rec["env"]["XLA_FLAGS"]
    if name in ("train", "sft", "eval"):
        assert rec["env"]["NCCL_DEBUG"] == "WARN"
    if name == "train":
        assert rec["prng"] == "rbg"
    if name == "plan":
        assert rec["platforms"] == "cpu"


def test_apply_env_refuses_changes_once_a_backend_exists_and_is_a_noop_otherwise(monkeypatch):
    import jax

    jax.devices()
    assert backend_exists()
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    assert apply_env({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, who="t") == {}  # nothing changes: allowed
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    with pytest.raises(BackendStartedError, match="XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 would be ignored"):
        apply_env({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}, who="t")
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ


def test_user_exported_values_win_and_xla_flags_merge(monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8")
    todo = changes({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3",
                    "XLA_FLAGS": "--xla_force_host_platform_device_count=2 --xla_gpu_enable_command_buffer="})
    assert todo == {"XLA_FLAGS": "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=8 "
                                 "--xla_gpu_enable_command_buffer="}
    assert merge_xla_flags("", "--a=1") == "--a=1"


def test_gpu_presets_ask_for_their_colocation_allocator_settings():
    from jaxrl_term.plan import compose
    from jaxrl_term.rollout.colocation import config_env

    time_share = config_env(compose(["+experiment=qwen32b_h100", "model.path=/m"]))
    assert time_share == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
    static = config_env(compose(["+experiment=tmax_qwen3_8b", "model.path=/m"]))
    assert static["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"  # a cap grown into, not taken at start
    assert set(static) == {"XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION"} and 0 < float(static["XLA_PYTHON_CLIENT_MEM_FRACTION"]) < 0.7
    assert config_env(compose(["+experiment=tiny_cpu"])) == {}
