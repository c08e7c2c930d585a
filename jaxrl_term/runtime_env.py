"""Environment before backend: the variables JAX, XLA and NCCL read once, when a client is created, set in one place.

``XLA_PYTHON_CLIENT_PREALLOCATE`` / ``_ALLOCATOR`` / ``_MEM_FRACTION``, ``XLA_FLAGS``, ``JAX_PLATFORMS`` and the
``NCCL_*`` variables are read when JAX creates its backend (the first ``jax.devices()``, ``jax.process_index()``,
array or compile) and never again. Set later, they do nothing, silently: on a GPU node the trainer then
preallocates 75% of every GPU and keeps it, so a colocated SGLang server finds no room for its KV cache. So every
entry point (train, sft, eval, plan, serve) calls :func:`apply_env` first, before anything may touch a backend, and
:func:`apply_env` refuses to run once a backend exists when it would change anything.

What a config asks for (``rollout.colocation.config_env``; this module imports nothing of the package): the colocation plan's allocator settings on GPU presets
(``rollout/colocation.py``: ``static`` caps XLA at what the servers leave; ``time_share`` turns preallocation off and
uses the platform allocator so the step's temporaries go back to the servers) and ``trainer.cluster.env`` (any
other variable, e.g. ``NCCL_IB_HCA`` or extra ``XLA_FLAGS``). A variable the user already exported wins, except
``XLA_FLAGS``, whose flags are merged (a flag the user gave keeps the user's value).

``JAX_*`` variables are read even earlier, when ``jax`` is imported; with jax imported, :func:`apply_env` sets them as
the config options they name (``JAX_PLATFORMS`` -> ``jax.config.update("jax_platforms", ...)``).
``jax.distributed.initialize`` does not create a backend and may come after this; ``jax.process_index()`` does.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
from collections.abc import Mapping

log = logging.getLogger(__name__)

# read by JAX/XLA/NCCL at client creation; listed so a mistyped key in trainer.cluster.env is caught
KNOWN_PREFIXES = ("XLA_", "JAX_", "NCCL_", "TF_", "CUDA_", "NVIDIA_", "TPU_", "LIBTPU_", "UCX_", "FI_", "GLOO_")


class BackendStartedError(RuntimeError):
    """A JAX backend already exists, so environment variables meant for its creation would be ignored."""


def backend_exists() -> bool:
    """Whether JAX has created a backend (client) in this process. Never creates one itself."""
    xb = sys.modules.get("jax._src.xla_bridge")
    return bool(xb is not None and getattr(xb, "_backends", None))


def _flag_name(flag: str) -> str:
    return flag.split("=", 1)[0]


def merge_xla_flags(current: str, wanted: str) -> str:
    """``current`` plus the flags of ``wanted`` that ``current`` does not set (the user's own value wins)."""
    have = {_flag_name(f) for f in shlex.split(current)}
    extra = [f for f in shlex.split(wanted) if _flag_name(f) not in have]
    return " ".join([*shlex.split(current), *extra])


def changes(env: Mapping[str, str], *, override: bool = False) -> dict[str, str]:
    """The variables ``apply_env`` would set (name -> new value), given the current ``os.environ``."""
    out: dict[str, str] = {}
    for k, v in env.items():
        v = str(v)
        cur = os.environ.get(k)
        if k == "XLA_FLAGS" and cur is not None and not override:
            v = merge_xla_flags(cur, v)
        elif cur is not None and not override:
            if cur != v:
                log.info("%s=%s is set in the environment; keeping it (the config asks for %s)", k, cur, v)
            continue
        if cur != v:
            out[k] = v
    return out


def apply_env(env: Mapping[str, str], *, who: str, override: bool = False) -> dict[str, str]:
    """Set ``env`` in ``os.environ`` before JAX creates a backend; returns what was set.

    Raises ``BackendStartedError`` when something would change but a backend already exists (the values would
    not reach it). With nothing to change it is a no-op either way, so library callers that already hold a
    backend (tests, notebooks) can build a CPU trainer. ``override``: replace values the user exported (the
    planner's fake CPU devices must win)."""
    todo = changes(env, override=override)
    if todo and backend_exists():
        raise BackendStartedError(
            f"{who}: JAX's backend already exists, so {', '.join(f'{k}={v}' for k, v in todo.items())} would be "
            "ignored (XLA reads these once, when its client is created). Something touched a device earlier: "
            "call jaxrl_term.runtime_env.apply_env before any jax.devices()/process_index()/array, or export the "
            "variables before starting Python")
    os.environ.update(todo)
    _jax_config(todo)
    if todo:
        log.info("%s: environment for the JAX backend: %s", who, " ".join(f"{k}={v}" for k, v in todo.items()))
    return todo


def _jax_config(env: Mapping[str, str]) -> None:
    """``JAX_*`` variables are read when ``jax`` is imported, not when the backend is created: with jax already
    imported (every entry point imports it through the config schema), set them as the config options they name."""
    jax = sys.modules.get("jax")
    if jax is None:
        return
    for k, v in env.items():
        if not k.startswith("JAX_"):
            continue
        name = k.lower()
        if name not in jax.config.values:
            raise ValueError(f"{k}: JAX has no config option {name!r}; check the name (trainer.cluster.env)")
        cur = jax.config.values[name]
        if isinstance(cur, bool):
            val: object = v.strip().lower() in ("1", "true", "yes", "on")
        elif isinstance(cur, int):
            val = int(v)
        elif isinstance(cur, float):
            val = float(v)
        else:
            val = v
        jax.config.update(name, val)


def env_problems(env: Mapping[str, object], where: str = "trainer.cluster.env") -> list[tuple[str, str, str]]:
    """Preflight: every key a variable name JAX/XLA/NCCL/CUDA reads, every value a string or number."""
    out = []
    for k, v in env.items():
        if not isinstance(k, str) or not k or not k.replace("_", "").isalnum() or k[0].isdigit():
            out.append((where, f"{k!r} is not an environment variable name", "use NAME: value"))
        elif not k.startswith(KNOWN_PREFIXES):
            out.append((f"{where}.{k}", "not a variable JAX, XLA, NCCL or CUDA reads at start-up "
                        f"(prefixes {', '.join(KNOWN_PREFIXES)})", "export other variables in the job script"))
        if isinstance(v, (dict, list)) or v is None:
            out.append((f"{where}.{k}", f"value {v!r} is not a string", 'quote it: NAME: "value"'))
    return out
