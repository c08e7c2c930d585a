"""Host-side messages between the JAX processes of one run, over ``jax.distributed``'s key-value store.

Only process 0 talks to engines, sandboxes and judges; the others need its batches (and a few small facts: the
warm-start demonstrations, the servers' URLs, a stop signal). These travel through the coordination service's
key-value store, not through a device collective: a follower waiting for the next batch blocks on a host RPC
instead of spinning in a collective on GPUs it shares with SGLang. With one process everything is local.

Values are numpy arrays (``np.savez``, no pickle) or JSON, split into chunks under a key prefix; a reader
blocks until the first key appears (the writer sets the chunk count last-but-first: all chunks, then the
header), so it never reads half a message.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes per key-value entry (well under gRPC's message limits)
FOREVER_MS = 7 * 24 * 3600 * 1000  # a follower waits as long as the lead's rollouts take


class HostChannel:
    """Process 0 -> every process messages, and barriers, for one run (``prefix`` namespaces the keys)."""

    def __init__(self, prefix: str = "jaxrl"):
        from jax._src import distributed

        # read from jax.distributed's state, not jax.process_index(): that would start the backends (and
        # allocate GPU memory) before this node's SGLang servers have taken theirs
        gs = distributed.global_state
        self.prefix = prefix
        self.index = int(gs.process_id or 0) if gs.client is not None else 0
        self.count = int(gs.num_processes or 1) if gs.client is not None else 1
        self.client = gs.client if self.count > 1 else None
        self._local: dict[str, Any] = {}

    @property
    def lead(self) -> bool:
        return self.index == 0

    # -- raw bytes ---------------------------------------------------------------------------------
    def _put(self, key: str, data: bytes) -> None:
        n = max(1, -(-len(data) // CHUNK))
        for i in range(n):
            self.client.key_value_set_bytes(f"{self.prefix}/{key}/{i}", data[i * CHUNK:(i + 1) * CHUNK])
        self.client.key_value_set(f"{self.prefix}/{key}/n", str(n))  # last: readers wait on this key

    def _get(self, key: str, timeout_ms: int) -> bytes:
        n = int(self.client.blocking_key_value_get(f"{self.prefix}/{key}/n", timeout_ms))
        return b"".join(self.client.blocking_key_value_get_bytes(f"{self.prefix}/{key}/{i}", timeout_ms)
                        for i in range(n))

    def delete(self, key: str) -> None:
        """Drop a message once every process has read it (the caller knows when: e.g. after a collective)."""
        if self.client is not None and self.lead:
            self.client.key_value_delete(f"{self.prefix}/{key}")  # the key and everything under key/

    # -- typed messages ----------------------------------------------------------------------------
    def broadcast_arrays(self, key: str, arrays: Mapping[str, np.ndarray] | None, meta: dict | None = None,
                         timeout_ms: int = FOREVER_MS) -> tuple[dict[str, np.ndarray] | None, dict]:
        """Process 0 sends ``arrays`` (or None = nothing, e.g. "stop") and a JSON ``meta``; every process gets
        them back. Others' arguments are ignored."""
        if self.count == 1:
            return (None if arrays is None else dict(arrays)), dict(meta or {})
        if self.lead:
            buf = io.BytesIO()
            if arrays is not None:
                np.savez(buf, **{k: np.asarray(v) for k, v in arrays.items()})
            self._put(f"{key}/meta", json.dumps({"none": arrays is None, **(meta or {})}).encode())
            self._put(f"{key}/arrays", buf.getvalue())
            return (None if arrays is None else dict(arrays)), dict(meta or {})
        header = json.loads(self._get(f"{key}/meta", timeout_ms))
        data = self._get(f"{key}/arrays", timeout_ms)
        none = header.pop("none")
        if none:
            return None, header
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            return {k: z[k] for k in z.files}, header

    def broadcast_json(self, key: str, value: Any = None, timeout_ms: int = FOREVER_MS) -> Any:
        """Process 0's JSON-serialisable ``value`` on every process."""
        if self.count == 1:
            return value
        if self.lead:
            self._put(key, json.dumps(value).encode())
            return value
        return json.loads(self._get(key, timeout_ms))

    def gather_json(self, key: str, value: Any, timeout_ms: int = FOREVER_MS) -> list[Any]:
        """Every process's ``value``, in process order, on every process."""
        if self.count == 1:
            return [value]
        self._put(f"{key}/{self.index}", json.dumps(value).encode())
        return [json.loads(self._get(f"{key}/{i}", timeout_ms)) for i in range(self.count)]

    def barrier(self, name: str, timeout_ms: int = FOREVER_MS) -> None:
        if self.client is not None:
            self.client.wait_at_barrier(f"{self.prefix}/{name}", timeout_ms)
