"""Device mesh, logical-axis rules and parameter placement.

Parameters and activations carry *logical* axis names (``embed``, ``mlp``, ``vocab``...). One rules table
(``conf/mesh/*.yaml``) maps each logical name to zero, one or several mesh axes (``data``, ``fsdp``,
``tensor``). Model code never names a mesh axis; changing the parallelism is changing the table.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

log = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

# The default table: parameters (and so optimizer state and gradients) fully sharded over every
# data-parallel device (the embedding dimension over data x fsdp: ZeRO-3 / FSDP "full shard"), tensor
# parallelism over heads / MLP / vocab, the batch over data x fsdp. Kept here so library users without Hydra get the same behaviour as
# conf/mesh/default.yaml (a test checks the two agree).
DEFAULT_RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": ("data", "fsdp"),
    "mlp": "tensor",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "layers": None,
    "norm": None,
    "activation_batch": ("data", "fsdp"),
    "activation_length": None,
    "activation_embed": None,
    "activation_heads": "tensor",
    "activation_kv_heads": "tensor",
    "activation_mlp": "tensor",
    "activation_vocab": "tensor",
}


class ShardingError(ValueError):
    """A logical axis cannot be placed on the mesh (unknown name, indivisible dimension)."""


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    """Logical axis name -> mesh axes. Hashable, so it can live in a jitted model's static graph."""

    table: tuple[tuple[str, tuple[str, ...]], ...]

    @classmethod
    def from_mapping(cls, rules: Mapping[str, Any] | None = None) -> LogicalRules:
        rules = DEFAULT_RULES if rules is None else rules
        items = []
        for name, axes in rules.items():
            if axes is None:
                axes_t: tuple[str, ...] = ()
            elif isinstance(axes, str):
                axes_t = (axes,)
            else:
                axes_t = tuple(axes)
            for a in axes_t:
                if a not in MESH_AXES:
                    raise ShardingError(
                        f"mesh rules: logical axis {name!r} maps to unknown mesh axis {a!r}; "
                        f"use one of {MESH_AXES} or null"
                    )
            items.append((str(name), axes_t))
        return cls(tuple(items))

    def mesh_axes(self, logical: str | None) -> tuple[str, ...]:
        if logical is None:
            return ()
        for name, axes in self.table:
            if name == logical:
                return axes
        raise ShardingError(
            f"mesh rules: no rule for logical axis {logical!r}; add it to conf/mesh/*.yaml (null = replicated)"
        )


def logical_to_spec(
    logical_axes: Sequence[str | None],
    rules: LogicalRules,
    mesh: Mesh,
    shape: Sequence[int] | None = None,
    what: str = "array",
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry ``logical_axes``.

    A mesh axis is used at most once per array (the first dimension that asks for it wins), and axes of
    size 1 are dropped. With ``shape`` given, every sharded dimension must divide evenly, otherwise a
    ``ShardingError`` names the array, the dimension and the rule to change.
    """
    used: set[str] = set()
    spec: list[Any] = []
    for dim, logical in enumerate(logical_axes):
        axes = [a for a in rules.mesh_axes(logical) if a not in used and mesh.shape.get(a, 1) > 1]
        used.update(axes)
        if shape is not None and axes:
            size = math.prod(mesh.shape[a] for a in axes)
            if shape[dim] % size:
                raise ShardingError(
                    f"{what}: dimension {dim} ({logical!r}, size {shape[dim]}) is not divisible by mesh axes "
                    f"{tuple(axes)} (size {size}); change the mesh shape or map {logical!r} elsewhere in the rules"
                )
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*spec)


@dataclasses.dataclass(frozen=True)
class ShardingCtx:
    """A mesh plus its rules; ``constrain`` is the identity when there is no mesh."""

    mesh: Mesh | None = None
    rules: LogicalRules = dataclasses.field(default_factory=LogicalRules.from_mapping)

    def spec(self, logical_axes: Sequence[str | None], shape=None, what="array") -> PartitionSpec:
        assert self.mesh is not None
        return logical_to_spec(logical_axes, self.rules, self.mesh, shape, what)

    def named(self, logical_axes: Sequence[str | None], shape=None, what="array") -> NamedSharding:
        assert self.mesh is not None
        return NamedSharding(self.mesh, self.spec(logical_axes, shape, what))

    def constrain(self, x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        if self.mesh is None or self.mesh.size == 1:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(logical_axes))


def make_mesh(
    shape: Mapping[str, int] | Sequence[int] | None = None, devices: Sequence[Any] | None = None
) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh over ``devices`` (all devices by default).

    ``shape`` maps axis -> size; one axis may be -1 ("the rest"). Missing axes are 1, except that with no
    shape at all every device goes to ``fsdp``.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    if shape is None:
        sizes = {"data": 1, "fsdp": -1, "tensor": 1}
    elif isinstance(shape, Mapping):
        unknown = set(shape) - set(MESH_AXES)
        if unknown:
            raise ShardingError(f"mesh.shape: unknown axes {sorted(unknown)}; the axes are {MESH_AXES}")
        sizes = {a: int(shape.get(a, 1)) for a in MESH_AXES}
    else:
        if len(shape) != len(MESH_AXES):
            raise ShardingError(f"mesh.shape: expected {len(MESH_AXES)} sizes {MESH_AXES}, got {list(shape)}")
        sizes = dict(zip(MESH_AXES, (int(s) for s in shape)))
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise ShardingError(f"mesh.shape: at most one axis may be -1, got {free}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n % fixed:
            raise ShardingError(f"mesh.shape {sizes}: {n} devices are not divisible by {fixed}")
        sizes[free[0]] = n // fixed
    if math.prod(sizes.values()) != n:
        raise ShardingError(
            f"mesh.shape {sizes} needs {math.prod(sizes.values())} devices but {n} are available; "
            "set one axis to -1 to take the rest"
        )
    dims = tuple(sizes[a] for a in MESH_AXES)
    try:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(dims, devices=devices)
    except Exception:  # noqa: BLE001 - topology-aware layout is best effort (CPU / odd device counts)
        arr = np.asarray(devices).reshape(dims)
    axis_types = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return Mesh(arr, MESH_AXES, axis_types=axis_types)


def _variables(state):
    from flax import nnx

    return jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]


def path_str(path) -> str:
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name == "value":
            continue
        parts.append(str(name))
    return ".".join(parts)


def state_shardings(state, ctx: ShardingCtx):
    """NamedSharding per Variable of an nnx state (abstract or concrete), from its ``logical_axes``."""
    from flax import nnx

    def one(path, v):
        axes = v.get_metadata().get("logical_axes")
        if axes is None:
            axes = (None,) * len(v.shape)
        return v.replace(ctx.named(axes, v.shape, path_str(path)))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model, ctx: ShardingCtx):
    """Place every parameter of an nnx model with the sharding its logical axes ask for (in place)."""
    from flax import nnx

    state = nnx.state(model)
    shardings = state_shardings(state, ctx)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, s), state, shardings)
    nnx.update(model, placed)
    return model


def initialize_distributed(
    *,
    enabled: bool = False,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout_s: int = 300,
) -> None:
    """``jax.distributed.initialize`` from config; with all fields None it auto-detects (SLURM, TPU, ...).

    Call before anything touches a device, after ``runtime_env.apply_env``; it creates no backend itself. A no-op
    when ``enabled`` is false.
    """
    if not enabled:
        return
    kwargs: dict[str, Any] = {"initialization_timeout": initialization_timeout_s}
    if coordinator_address is not None:
        kwargs["coordinator_address"] = coordinator_address
    if num_processes is not None:
        kwargs["num_processes"] = num_processes
    if process_id is not None:
        kwargs["process_id"] = process_id
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    jax.distributed.initialize(**kwargs)
    # from the coordination client's state: jax.process_index() / device counts would create the backend here,
    # before the node's SGLang servers have taken their memory (runtime_env.py)
    from jax._src import distributed

    gs = distributed.global_state
    log.info("jax.distributed: process %s of %s (coordinator %s)", gs.process_id, gs.num_processes,
             gs.coordinator_address)
