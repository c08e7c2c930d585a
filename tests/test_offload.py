"""Host-offloaded AdamW: the same updates as the on-device step, an fp32 master under a bf16 device copy, skipped
steps that touch nothing, exact checkpoints, and optax's clipping and weight-decay mask."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_term.model.hf import load_pretrained, save_pretrained
from jaxrl_term.model.qwen3 import ModelOptions
from jaxrl_term.parallel.mesh import make_mesh
from jaxrl_term.rl.batch import Sample, make_batch
from jaxrl_term.rl.offload import make_offload_train_step
from jaxrl_term.rl.step import AlgoConfig, OptimConfig, make_optimizer, make_train_step
from jaxrl_term.utils.checkpoint import Checkpointer
from tests.test_rl_step import CFG, params0, samples

ADAMW = OptimConfig(lr=1e-3, weight_decay=0.1, grad_clip=1e9)  # decay on, clipping off (tested on its own)
ALGO = AlgoConfig(microbatches=2)


@pytest.fixture(scope="module")
def steps():
    """(on-device TrainStep, HostOffloadTrainStep) with ADAMW per mesh, built once: compiling dominates here."""
    built = {}

    def get(mesh: str):
        if mesh not in built:
            m = make_mesh({"data": 1, "fsdp": 8, "tensor": 1}) if mesh == "fsdp8" else None
            built[mesh] = (make_train_step(CFG, ALGO, ADAMW, m), make_offload_train_step(CFG, ALGO, ADAMW, m))
        return built[mesh]

    return get


def batches(n, rows=16):
    return [make_batch(samples(rows, seed=10 + k), buckets=(32,), row_multiple=8) for k in range(n)]


def host_copy(tree):
    """numpy copies: a view would pin a host buffer, and the next update would copy it instead of updating it in
    place (JAX does not donate a buffer that numpy still references)."""
    return [np.array(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_params_close(a, b, lr):
    """fp32 agreement of two runs' params. Adam divides by sqrt(v): a gradient that is a sum with cancellation
    (an embedding row) carries the fp32 noise of its reduction order into the step, so a step may differ by a
    small fraction of lr (here < 0.3%; microbatch gradients are summed on the host in another order)."""
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=3e-3 * lr)


def assert_moments_close(a, b):
    """Adam moments: each leaf within fp32 reduction noise of the gradients, relative to its largest value."""
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * np.abs(x).max())


@pytest.mark.parametrize("mesh", ["one", "fsdp8"])
def test_fp32_offload_equals_the_on_device_step(steps, mesh):
    ts, off = steps(mesh)
    state, ostate = ts.init_state(params0()), off.init_state(params0())
    for batch in batches(3):
        state, m = ts(state, batch)
        ostate, om = off(ostate, batch)
        assert om["skipped"] == 0.0 and om["offload/host_update_s"] > 0 and om["offload/transfer_s"] > 0
        assert set(om) == set(m) | {"offload/host_update_s", "offload/transfer_s"}
        for k, v in m.items():
            assert om[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    master = jax.tree.leaves(off.master_params(ostate))
    assert_params_close(host_copy(state.params), master, ADAMW.lr)
    # the device copy is the master (fp32 compute: bit for bit), placed like the on-device params
    for x, y in zip(master, host_copy(ostate.params), strict=True):
        np.testing.assert_array_equal(x, y)
    for a, b in zip(jax.tree.leaves(ostate.params), jax.tree.leaves(state.params), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert int(ostate.count) == int(ostate.step) == 3
    adam = state.opt_state[1][0]  # (clip, (adam, decay, lr)): optax's moments
    assert_moments_close(host_copy(adam.mu), jax.tree.leaves(off.model_layout(ostate.mu)))
    assert_moments_close(host_copy(adam.nu), jax.tree.leaves(off.model_layout(ostate.nu)))


def test_host_state_lives_on_the_cpu_and_is_updated_in_place(steps):
    _, off = steps("one")
    state = off.init_state(params0())
    host = jax.tree.leaves((state.master, state.mu, state.nu))
    assert all(x.devices() == {jax.devices("cpu")[0]} and x.dtype == jnp.float32 for x in host)
    ptrs = [x.unsafe_buffer_pointer() for x in host]
    state, _ = off(state, batches(1)[0])
    # donated: no second copy of the master or the moments is ever allocated
    assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves((state.master, state.mu, state.nu))] == ptrs


def test_update_matches_with_old_policy_pass_reference_pass_and_epochs():
    algo = AlgoConfig(use_old_logp=True, recompute_old_logp=True, epochs=2, kl_coef=0.1)
    ts, off = make_train_step(CFG, algo, ADAMW), make_offload_train_step(CFG, algo, ADAMW)
    ref = params0(seed=1)
    state, ostate = ts.init_state(params0()), off.init_state(params0())
    batch = batches(1)[0]
    state, hist = ts.update(state, batch, ref_params=ref)
    ostate, ohist = off.update(ostate, batch, ref_params=off.device_params(ref))
    assert len(ohist) == 2 and ohist[0]["ratio"] == pytest.approx(1.0, abs=1e-5) and ohist[0]["kl"] > 1e-4
    for m, om in zip(hist, ohist, strict=True):
        for k, v in m.items():
            assert om[k] == pytest.approx(v, rel=1e-5, abs=1e-7), k
    assert_params_close(host_copy(state.params), jax.tree.leaves(off.master_params(ostate)), ADAMW.lr)
    with pytest.raises(ValueError, match="ref_params"):
        off.update(ostate, batch)


def test_bf16_device_copy_keeps_an_fp32_master_that_tracks_small_updates():
    optim = OptimConfig(lr=1e-6, weight_decay=0.0, grad_clip=1e9)
    opts = ModelOptions(param_dtype="float32", compute_dtype="bfloat16")
    off = make_offload_train_step(CFG, ALGO, optim, options=opts)
    ts = make_train_step(CFG, ALGO, optim, options=opts)  # on device: fp32 params, bf16 compute
    p0 = host_copy(params0())
    ostate, state = off.init_state(params0()), ts.init_state(params0())
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(ostate.params))
    for batch in batches(3):
        ostate, om = off(ostate, batch)
        state, m = ts(state, batch)
        assert om["loss"] == pytest.approx(m["loss"], rel=1e-3)
    master = jax.tree.leaves(off.master_params(ostate))
    assert all(x.dtype == np.float32 for x in master)
    n = sum(p.size for p in p0)
    assert sum(int((x != p).sum()) for x, p in zip(master, p0)) / n > 0.9
    # the same ~1e-6 steps applied to bf16 weights would mostly round away
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16))
    assert sum(int((bf16(bf16(p) + (x - p)) != bf16(p)).sum()) for x, p in zip(master, p0)) / n < 0.1
    # the device copy is the master rounded to bf16
    for x, d in zip(master, host_copy(ostate.params), strict=True):
        np.testing.assert_array_equal(bf16(x), d)
    # the updates match the on-device fp32-master / bf16-compute step. Adam steps are ~lr each; where a
    # gradient is a near-cancelling sum (an embedding row), bf16 rounding can flip its sign, so a few elements
    # may differ by a couple of steps
    steps3 = 3 * optim.lr
    d = np.concatenate([np.abs((x - p) - (y - p)).ravel() for x, y, p in zip(master, host_copy(state.params), p0)])
    assert d.max() <= 2 * steps3 and np.mean(d <= 0.05 * steps3) >= 0.99, (d.max(), np.mean(d <= 0.05 * steps3))


def test_skipped_update_leaves_everything_bit_identical(steps):
    _, off = steps("fsdp8")
    b1, b2 = batches(2)
    masked = make_batch([Sample([1, 2, 3], [0, 0, 0], [0.0] * 3, 1.0)] * 16, buckets=(32,), row_multiple=8)
    state, _ = off(off.init_state(params0()), b1)
    before = host_copy((state.params, state.master, state.mu, state.nu, state.count))
    state, m = off(state, masked)
    assert m["skipped"] == 1.0 and int(state.step) == 2 and int(state.count) == 1
    for x, y in zip(before, host_copy((state.params, state.master, state.mu, state.nu, state.count)), strict=True):
        np.testing.assert_array_equal(x, y)
    # the optimizer did not advance: the next update is the one an uninterrupted run makes
    state, _ = off(state, b2)
    plain, _ = off(off(off.init_state(params0()), b1)[0], b2)
    for x, y in zip(host_copy((plain.master, plain.mu, plain.nu)), host_copy((state.master, state.mu, state.nu))):
        np.testing.assert_array_equal(x, y)


def test_checkpoint_restore_then_continue_equals_an_uninterrupted_run(steps, tmp_path):
    _, off = steps("fsdp8")
    b1, b2, b3 = batches(3)
    state, _ = off(off(off.init_state(params0()), b1)[0], b2)
    saved = host_copy(state)
    with Checkpointer(tmp_path, async_save=False) as ck:
        ck.save(2, state, {"step": 2})
        restored, meta = ck.restore(off.abstract_state())
    assert meta == {"step": 2}
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for x, y in zip(saved, host_copy(restored), strict=True):
        assert x.dtype == y.dtype
        np.testing.assert_array_equal(x, y)
    host = jax.devices("cpu")[0]
    assert all(x.devices() == {host} for x in jax.tree.leaves((restored.master, restored.mu, restored.nu)))
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params), strict=True):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    state, m = off(state, b3)
    restored, rm = off(restored, b3)
    drop = lambda d: {k: v for k, v in d.items() if not k.startswith("offload/")}
    assert drop(rm) == drop(m)
    for x, y in zip(host_copy(state), host_copy(restored), strict=True):
        np.testing.assert_array_equal(x, y)


def test_fp32_export_of_the_master_round_trips(steps, tmp_path):
    _, off = steps("one")
    state, _ = off(off.init_state(params0()), batches(1)[0])
    save_pretrained(off.model(off.master_params(state)), tmp_path / "hf", "float32")
    loaded = nnx.to_pure_dict(nnx.state(load_pretrained(tmp_path / "hf"), nnx.Param))
    for x, y in zip(jax.tree.leaves(off.master_params(state)), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_clipping_matches_optax(steps):
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, grad_clip=1e-4)
    off = dataclasses.replace(steps("one")[1], optim=optim)  # the optimizer lives on the host: same device program
    tx = make_optimizer(optim)
    ref = jax.tree.map(np.asarray, params0())
    opt_state = tx.init(ref)
    ostate = off.init_state(params0())
    for batch in batches(2):
        # optax on the same gradients (at the reference params), as make_optimizer composes it
        grads, ok, gm = off.inner._grad_step(off.device_params(ref), off.place_batch(batch))
        assert bool(ok) and float(gm["grad_norm"]) > 10 * optim.grad_clip  # clipping is active
        updates, opt_state = jax.jit(tx.update)(grads, opt_state, ref)
        ref = jax.tree.map(np.asarray, optax.apply_updates(ref, updates))
        ostate, _ = off(ostate, batch)
        assert_params_close(jax.tree.leaves(ref), jax.tree.leaves(off.master_params(ostate)), optim.lr)
        assert_moments_close(host_copy(opt_state[1][0].mu), jax.tree.leaves(off.model_layout(ostate.mu)))
        assert_moments_close(host_copy(opt_state[1][0].nu), jax.tree.leaves(off.model_layout(ostate.nu)))


def test_weight_decay_applies_to_matrices_and_not_to_norms(steps):
    """The decay mask (step.py's _decay_mask) on every leaf, and the host kernel on a zero gradient: Adam's step is
    0 / (0 + eps), so the update is the decay alone, p - lr * wd * p (a batch with no learning signal is skipped
    before it reaches the kernel, see test_skipped_update_leaves_everything_bit_identical)."""
    from jaxrl_term.rl.offload import _adamw_slice, _hyper, _step_scalars

    _, off = steps("one")
    decays = {leaf.shape: leaf.decay for leaf in off.leaves}
    names = jax.tree_util.tree_leaves_with_path(params0())
    lr, wd = np.float32(ADAMW.lr), np.float32(ADAMW.weight_decay)
    scalars = _step_scalars(jnp.zeros((), jnp.int32), jnp.float32(0.0), hyper=_hyper(ADAMW))
    scalars = {k: v for k, v in scalars.items() if k != "lr"}
    decayed = []
    for (path, p), leaf in zip(names, off.leaves, strict=True):
        name = str(path[-1].key)
        assert leaf.decay == (not name.endswith("norm")), name
        p = np.asarray(p, np.float32)
        q, _, _, _ = _adamw_slice(jnp.array(p), jnp.zeros_like(p), jnp.zeros_like(p), jnp.zeros_like(p), scalars,
                                  decay=leaf.decay, hyper=_hyper(ADAMW), cdtype="float32")
        if leaf.decay:
            np.testing.assert_allclose(np.asarray(q), p - lr * (wd * p), rtol=2.4e-7, atol=0)  # 2 ulps
            decayed.append(name)
        else:
            np.testing.assert_array_equal(np.asarray(q), p)
    assert {"q_proj", "down_proj", "embed_tokens", "lm_head"} <= set(decayed) and decays


def test_multi_process_and_bf16_master_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="param_dtype=float32"):
        make_offload_train_step(CFG, ALGO, ADAMW, options=ModelOptions(param_dtype="bfloat16"))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ValueError, match="optim.offload"):
        make_offload_train_step(CFG, ALGO, ADAMW)
