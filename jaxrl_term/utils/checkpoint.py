"""Orbax checkpoints of the whole training state plus a JSON blob (data cursor, policy version, ...).

Saves are asynchronous (the step continues while arrays are written); ``restore`` reads onto whatever
shardings the target describes, so a run can resume on a different mesh. Keeps the last N checkpoints.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = 3,
        save_interval_steps: int = 1,
        async_save: bool = True,
    ):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            save_interval_steps=save_interval_steps,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: Any, meta: dict | None = None, *, force: bool = False) -> bool:
        """Start saving ``state`` (a pytree of jax arrays) and ``meta`` (JSON) as ``step``; False if skipped
        by ``save_interval_steps``. Returns before the write finishes when async; ``wait()`` blocks."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta or {}))
        saved = self._mngr.save(int(step), args=args, force=force)
        if saved:
            log.info("checkpoint %d -> %s", step, self.directory)
        return saved

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._mngr.all_steps())

    def restore(self, target: Any, step: int | None = None) -> tuple[Any, dict]:
        """Restore onto ``target``: a pytree of ``jax.ShapeDtypeStruct`` with shardings (e.g.
        ``TrainStep.abstract_state()`` of the new mesh). Returns (state, meta)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint to restore")
        args = ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        out = self._mngr.restore(int(step), args=args)
        return out.state, dict(out.meta or {})

    def restore_params(self, target: Any, step: int | None = None) -> tuple[Any, int]:
        """Only the policy's parameters of a saved train state (no optimizer state is read): ``target`` is a
        pytree of ``jax.ShapeDtypeStruct`` (with shardings) shaped like ``TrainState.params``. Returns
        (params, step). For evaluation and export, whatever optimizer the run used."""
        import jax

        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"{self.directory}: no checkpoint to restore")
        if step not in self.all_steps():
            raise FileNotFoundError(f"{self.directory}: no step {step} (have {self.all_steps()})")
        restore_args = jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=getattr(s, "sharding", None),
                                                                   global_shape=s.shape, dtype=s.dtype), target)
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(item={"params": target},
                                                               restore_args={"params": restore_args},
                                                               partial_restore=True))
        out = self._mngr.restore(int(step), args=args)
        return out.state["params"], int(step)

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def close(self) -> None:
        self._mngr.wait_until_finished()
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs (with the same shardings) for a concrete pytree of arrays."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
