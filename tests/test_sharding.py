"""On 8 fake CPU devices: sharded logits equal unsharded ones, and parameters sit where the rules say."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from omegaconf import OmegaConf

from conftest import REPO
from helpers import TINY, hf_checkpoint
from jaxrl_term.model.hf import load_pretrained
from jaxrl_term.parallel.mesh import DEFAULT_RULES, LogicalRules, ShardingError, make_mesh

# What conf/mesh/default.yaml says, written out per parameter (stacked layer params lead with `layers`):
# the hidden ("embed") dimension is sharded over every data-parallel device (data x fsdp, full shard).
DP = ("data", "fsdp")
EXPECTED = {
    "embed_tokens": P("tensor", DP),
    "lm_head": P(DP, "tensor"),
    "norm": P(),
    "layers.q_proj": P(None, DP, "tensor", None),
    "layers.k_proj": P(None, DP, "tensor", None),
    "layers.v_proj": P(None, DP, "tensor", None),
    "layers.o_proj": P(None, "tensor", None, DP),
    "layers.gate_proj": P(None, DP, "tensor"),
    "layers.up_proj": P(None, DP, "tensor"),
    "layers.down_proj": P(None, "tensor", DP),
    "layers.q_norm": P(),
    "layers.input_layernorm": P(),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    hf_checkpoint(path, rope_theta=10_000.0)
    return path


def _get(model, dotted):
    for part in dotted.split("."):
        model = getattr(model, part)
    return model[...]


def test_there_are_eight_fake_devices():
    assert jax.device_count() == 8


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2), (1, 4, 2)])
def test_sharded_logits_equal_unsharded_and_params_follow_rules(ckpt, shape):
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, TINY["vocab_size"], (8, 10)), jnp.int32)
    mask = jnp.asarray(np.arange(10)[None] < rng.randint(4, 11, (8, 1)), jnp.int32)
    ref = np.asarray(load_pretrained(ckpt)(ids, mask))

    mesh = make_mesh(dict(zip(("data", "fsdp", "tensor"), shape)))
    rules = OmegaConf.to_container(OmegaConf.load(REPO / "conf/mesh/default.yaml"))["rules"]
    model = load_pretrained(ckpt, mesh=mesh, rules=rules)
    for name, spec in EXPECTED.items():
        arr = _get(model, name)
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim), (name, arr.sharding.spec)
        assert len(arr.addressable_shards) == 8
    out = jax.jit(lambda m, i, a: m(i, a))(model, ids, mask)
    valid = np.asarray(mask).astype(bool)
    assert np.abs(np.asarray(out) - ref)[valid].max() <= 1e-5


def test_rules_table_in_config_is_the_library_default():
    rules = OmegaConf.to_container(OmegaConf.load(REPO / "conf/mesh/default.yaml"))["rules"]
    assert LogicalRules.from_mapping(rules) == LogicalRules.from_mapping(DEFAULT_RULES)


def test_a_different_rules_table_moves_the_parameters(ckpt):
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    rules = {**DEFAULT_RULES, "embed": None, "mlp": "fsdp"}
    model = load_pretrained(ckpt, mesh=mesh, rules=rules)
    gate = model.layers.gate_proj[...]
    assert gate.sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "fsdp")), 3)


def test_mesh_shape_errors_are_clear():
    with pytest.raises(ShardingError, match="at most one axis may be -1"):
        make_mesh({"data": -1, "fsdp": -1})
    with pytest.raises(ShardingError, match="needs 16 devices but 8 are available"):
        make_mesh({"data": 4, "fsdp": 4})
    with pytest.raises(ShardingError, match="unknown axes"):
        make_mesh({"pipeline": 2})
    assert make_mesh({"tensor": 2, "data": -1}).shape == {"data": 4, "fsdp": 1, "tensor": 2}


def test_indivisible_dimension_names_the_parameter(ckpt):
    mesh = make_mesh({"tensor": 8})  # 2 kv heads cannot split 8 ways
    with pytest.raises(ShardingError, match=r"layers\.k_proj: dimension 2 \('kv_heads', size 2\)"):
        load_pretrained(ckpt, mesh=mesh)
