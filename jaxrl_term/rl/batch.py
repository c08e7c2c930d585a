"""Trajectories -> fixed-shape training arrays.

Rows are padded to a small set of length buckets (and the row count to a multiple), so the jitted step
compiles a handful of times rather than once per batch. Optional packing puts several sequences in a row,
told apart by ``segment_ids`` (0 = padding) that the model's attention and the aggregation respect.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from flax import struct

DEFAULT_BUCKETS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class BatchError(ValueError):
    """A sample that cannot go into a batch (the message names the sample and the field)."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One trajectory as the trainer sees it: token ids, which of them the policy produced, and their
    engine log-probs (aligned with ``tokens``; 0 where ``loss_mask`` is 0), plus the trajectory's advantage."""

    tokens: Sequence[int]
    loss_mask: Sequence[int]
    rollout_logprobs: Sequence[float]
    advantage: float
    fresh: bool = True  # sampled entirely by the weights being trained (lag 0): its engine/trainer gap is numerics


@struct.dataclass
class Batch:
    """[B, T] arrays (or [M, B/M, T] once split into microbatches). Per-token arrays align with ``tokens``."""

    tokens: np.ndarray  # int32
    positions: np.ndarray  # int32, restarting at 0 for every packed segment
    segment_ids: np.ndarray  # int32, 1.. per sequence in a row, 0 = padding
    loss_mask: np.ndarray  # float32, 1 on policy tokens
    advantages: np.ndarray  # float32, the sequence's advantage on each of its tokens
    rollout_logp: np.ndarray  # float32, engine log-probs (mu)
    old_logp: np.ndarray  # float32, behaviour log-probs for PPO ratios (defaults to rollout_logp)
    ref_logp: np.ndarray  # float32, reference-policy log-probs (zeros unless a KL term is used)
    fresh: np.ndarray  # float32, 1 on the tokens of samples drawn by the weights being trained (lag 0)

    @property
    def attention_mask(self):
        return (self.segment_ids > 0).astype(np.int32)

    @property
    def shape(self):
        return self.tokens.shape

    def num_loss_tokens(self) -> int:
        return int(np.asarray(self.loss_mask).sum())


def _validate(i: int, s: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tok = np.asarray(s.tokens, np.int64)
    mask = np.asarray(s.loss_mask, np.float32)
    lp = np.asarray(s.rollout_logprobs, np.float32)
    if not (len(tok) == len(mask) == len(lp)):
        raise BatchError(
            f"sample {i}: tokens ({len(tok)}), loss_mask ({len(mask)}) and rollout_logprobs ({len(lp)}) "
            "must have the same length"
        )
    if len(tok) < 2:
        raise BatchError(f"sample {i}: needs at least 2 tokens (a prompt and one policy token), got {len(tok)}")
    if not set(np.unique(mask)).issubset({0.0, 1.0}):
        raise BatchError(f"sample {i}: loss_mask must be 0/1")
    if mask[0] != 0:
        raise BatchError(f"sample {i}: loss_mask[0] is 1, but the first token has no context to be scored from")
    if (tok < 0).any():
        raise BatchError(f"sample {i}: negative token id {int(tok.min())}")
    if not np.isfinite(s.advantage):
        raise BatchError(f"sample {i}: advantage is {s.advantage}; rewards and advantages must be finite")
    on = mask > 0
    if not np.isfinite(lp[on]).all() or (lp[on] > 1e-4).any():
        raise BatchError(f"sample {i}: rollout_logprobs on policy tokens must be finite log-probs (<= 0)")
    return tok, mask, np.where(on, lp, 0.0)


def pick_bucket(length: int, buckets: Sequence[int]) -> int:
    for b in sorted(buckets):
        if length <= b:
            return b
    raise BatchError(
        f"a sequence of {length} tokens is longer than the largest length bucket ({max(buckets)}); "
        "add a bucket (rl batch buckets) or lower the rollout's max context"
    )


def make_batch(
    samples: Sequence[Sample],
    *,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    row_multiple: int = 1,
    pack: bool = False,
    pack_len: int | None = None,
    pad_id: int = 0,
    vocab_size: int | None = None,
) -> Batch:
    """Samples -> a padded ``Batch`` (numpy). Rows are padded to a multiple of ``row_multiple`` (the
    data-parallel shard count; see ``microbatch_layout``) with empty rows that carry no loss."""
    if not samples:
        raise BatchError("make_batch: no samples")
    checked = [_validate(i, s) for i, s in enumerate(samples)]
    if vocab_size is not None:
        for i, (tok, _, _) in enumerate(checked):
            if tok.max() >= vocab_size:
                raise BatchError(f"sample {i}: token id {int(tok.max())} >= model vocab_size {vocab_size}")
    lengths = [len(c[0]) for c in checked]
    if pack:
        t = pick_bucket(max(pack_len or 0, max(lengths)), buckets)
        rows = _first_fit_decreasing(lengths, t)
    else:
        t = pick_bucket(max(lengths), buckets)
        rows = [[i] for i in range(len(samples))]
    n_rows = -(-len(rows) // row_multiple) * row_multiple
    out = {
        "tokens": np.full((n_rows, t), pad_id, np.int32),
        "positions": np.zeros((n_rows, t), np.int32),
        "segment_ids": np.zeros((n_rows, t), np.int32),
        "loss_mask": np.zeros((n_rows, t), np.float32),
        "advantages": np.zeros((n_rows, t), np.float32),
        "rollout_logp": np.zeros((n_rows, t), np.float32),
        "fresh": np.zeros((n_rows, t), np.float32),
    }
    for r, members in enumerate(rows):
        at = 0
        for seg, i in enumerate(members, start=1):
            tok, mask, lp = checked[i]
            n = len(tok)
            sl = slice(at, at + n)
            out["tokens"][r, sl] = tok
            out["positions"][r, sl] = np.arange(n)
            out["segment_ids"][r, sl] = seg
            out["loss_mask"][r, sl] = mask
            out["advantages"][r, sl] = samples[i].advantage
            out["rollout_logp"][r, sl] = lp
            out["fresh"][r, sl] = 1.0 if samples[i].fresh else 0.0
            at += n
    return Batch(**out, old_logp=out["rollout_logp"].copy(), ref_logp=np.zeros_like(out["rollout_logp"]))


def _first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def microbatch_layout(rows: int, shards: int, microbatches: int = 1) -> tuple[int, int]:
    """(M, b): how ``rows`` trajectory rows run as M microbatches of b rows on ``shards`` data-parallel shards.

    Rows are padded only to a multiple of the shard count (R rows per shard), never to
    ``microbatches x shards``: 32 trajectories on 32 shards are one microbatch of 32 rows, not 16 microbatches
    of 32 rows (512 rows, 16x the compute). ``microbatches`` bounds memory: a microbatch holds at most
    ceil(R / microbatches) rows per shard; among the divisors k of R within that bound the largest is used,
    so there are at least ``microbatches`` microbatches whenever R allows it, and M x b = R x shards exactly.
    """
    if rows < 1 or shards < 1:
        raise BatchError(f"microbatch_layout: rows={rows} and shards={shards} must be positive")
    per_shard = -(-rows // shards)
    k_max = max(1, -(-per_shard // max(int(microbatches), 1)))
    k = max(d for d in range(1, k_max + 1) if per_shard % d == 0)
    return per_shard // k, k * shards


def to_microbatches(batch: Batch, n: int) -> Batch:
    """[B, T] -> [n, B/n, T]; row i goes to microbatch i % n, so sorted or packed rows spread evenly."""
    b = batch.tokens.shape[0]
    if b % n:
        raise BatchError(f"{b} rows do not split into {n} microbatches; build the batch with row_multiple={n}")

    def split(x):
        x = np.asarray(x)
        return x.reshape(b // n, n, *x.shape[1:]).swapaxes(0, 1)

    return Batch(**{f.name: split(getattr(batch, f.name)) for f in dataclasses.fields(Batch)})


def from_microbatches(x: np.ndarray) -> np.ndarray:
    """Inverse of ``to_microbatches`` for one [n, B/n, ...] array."""
    x = np.asarray(x)
    return x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
