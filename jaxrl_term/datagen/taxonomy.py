"""The task taxonomy (Tmax's: domain x skill type x primitive skills x persona x language x complexity x fixture x
verifier) and a seeded sampler of task specs over it.

The taxonomy is read at run time from a YAML file (ours: ``../shared/datasets/tmax-taxonomy/taxonomy.yaml``, or a
user's with the same schema). Sampling follows the file's ``sampling`` and ``legacy_v2_mixing`` sections:

- domain uniform; skill type, persona uniform within the domain; 3-5 primitive skills without replacement from all
  of the domain's skill lists; command complexity uniform; language by weight; a real-software anchor of the
  domain with probability ``real_software_anchor.probability``.
- task complexity, verifier kind and fixture kind per *corpus kind*: ``legacy`` keeps the legacy defaults
  (exact-text verifier, text-only fixture, complexity uniform over the legacy pool); ``sft_v2`` / ``rl_v2`` draw
  the *new* bucket of an axis with probability M / (M + 1) and the legacy bucket with 1 / (M + 1) (M: the
  corpus's multiplier for that axis, ``.inf`` = new bucket only), uniformly within a bucket. The probabilities
  derived from the rule are checked against the file's ``derived_sampling_probabilities`` when it lists them.
- a *mix* draws the corpus kind of each spec first: ``tmax_15k`` in proportion to the published dataset's
  surviving counts per part (``tmax_15k.parts[].surviving``).

Spec ``i`` of seed ``s`` comes from its own generator (seeded by ``s`` and ``i``), so the first N specs of a
larger draw are the N specs of a smaller one and a resumed run draws the same specs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from jaxrl_term.utils.paths import shared_dir

DEFAULT_TAXONOMY = shared_dir() / "datasets" / "tmax-taxonomy" / "taxonomy.yaml"
MIXED_AXES = ("task_complexity", "verifier_kind", "fixture_kind")  # the axes the corpus kind decides
SPEC_KEYS = ("spec_id", "corpus_kind", "domain", "skill_type", "primitive_skills", "persona", "command_complexity",
             "task_complexity", "verifier_kind", "fixture_kind", "language", "real_software_anchor", "base_image")


class TaxonomyError(ValueError):
    """A taxonomy file that cannot be used; the message names the file and the field."""


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """What the teacher is asked to write: one point of the taxonomy."""

    spec_id: str
    corpus_kind: str
    domain: str
    skill_type: str
    primitive_skills: tuple[str, ...]
    persona: str
    command_complexity: str
    task_complexity: str
    verifier_kind: str
    fixture_kind: str
    language: str
    real_software_anchor: str | None
    base_image: str

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["primitive_skills"] = list(self.primitive_skills)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any], where: str = "spec") -> TaskSpec:
        missing = [k for k in SPEC_KEYS if k not in d]
        if missing:
            raise TaxonomyError(f"{where}: missing keys {missing}")
        return cls(**{k: (tuple(d[k]) if k == "primitive_skills" else d[k]) for k in SPEC_KEYS})


@dataclasses.dataclass(frozen=True)
class Domain:
    name: str
    base_image: str
    skill_types: Mapping[str, tuple[str, ...]]  # skill type -> primitive skills
    personas: tuple[str, ...]
    anchors: tuple[str, ...]

    @property
    def primitives(self) -> tuple[str, ...]:
        return tuple(p for ps in self.skill_types.values() for p in ps)


@dataclasses.dataclass(frozen=True)
class Taxonomy:
    path: str
    domains: Mapping[str, Domain]
    languages: Mapping[str, float]  # name -> weight (normalised)
    command_complexity: tuple[str, ...]
    primitive_count: tuple[int, int]
    anchor_probability: float
    corpus_kinds: tuple[str, ...]
    # corpus kind -> axis -> value -> probability
    corpus_axes: Mapping[str, Mapping[str, Mapping[str, float]]]
    legacy_values: Mapping[str, frozenset[str]]  # axis -> values of the legacy bucket
    intricate_image: str | None
    mixes: Mapping[str, Mapping[str, float]]  # mix name -> corpus kind -> probability

    # -- sampling -------------------------------------------------------------------------------------------
    def corpus_probs(self, mix: str | None = None, corpus: str | None = None) -> dict[str, float]:
        """The corpus-kind distribution of a draw: one corpus kind, or a named mix (default ``tmax_15k``)."""
        if corpus is not None and mix is not None:
            raise TaxonomyError("give --mix or --corpus, not both")
        if corpus is not None:
            if corpus not in self.corpus_kinds:
                raise TaxonomyError(f"{self.path}: corpus kind {corpus!r} is not in legacy_v2_mixing.corpus_kinds "
                                    f"{list(self.corpus_kinds)}")
            return {corpus: 1.0}
        mix = mix or "tmax_15k"
        if mix not in self.mixes:
            raise TaxonomyError(f"{self.path}: no mix {mix!r}; this taxonomy defines {sorted(self.mixes)} "
                                "(a top-level section with parts[].corpus_kind and parts[].surviving)")
        return dict(self.mixes[mix])

    def sample(self, n: int, seed: int = 0, *, mix: str | None = None, corpus: str | None = None,
               start: int = 0) -> list[TaskSpec]:
        """Specs ``start`` .. ``start + n - 1`` of the draw with ``seed``."""
        probs = self.corpus_probs(mix, corpus)
        return [self._one(i, seed, probs) for i in range(start, start + n)]

    def _one(self, i: int, seed: int, corpus_probs: Mapping[str, float]) -> TaskSpec:
        rng = random.Random(f"jaxrl_term.datagen:{seed}:{i}")
        corpus = _weighted(rng, corpus_probs)
        dom = self.domains[rng.choice(sorted(self.domains))]
        skill_type = rng.choice(list(dom.skill_types))
        lo, hi = self.primitive_count
        pool = dom.primitives
        k = min(rng.randint(lo, hi), len(pool))
        primitives = tuple(rng.sample(pool, k))
        persona = rng.choice(dom.personas)
        command = rng.choice(self.command_complexity)
        mixed = {ax: _weighted(rng, self.corpus_axes[corpus][ax]) for ax in MIXED_AXES}
        language = _weighted(rng, self.languages)
        anchor = None
        if dom.anchors and rng.random() < self.anchor_probability:
            anchor = rng.choice(dom.anchors)
        novel = any(mixed[ax] not in self.legacy_values[ax] for ax in MIXED_AXES)
        image = self.intricate_image if (novel and self.intricate_image) else dom.base_image
        digest = hashlib.sha256(f"{seed}:{i}".encode()).hexdigest()[:6]
        return TaskSpec(f"{corpus}-{dom.name}-s{seed}-{i:06d}-{digest}", corpus, dom.name, skill_type, primitives,
                        persona, command, mixed["task_complexity"], mixed["verifier_kind"], mixed["fixture_kind"],
                        language, anchor, image)

    # -- target shares ----------------------------------------------------------------------------------------
    def expected_shares(self, mix: str | None = None, corpus: str | None = None) -> dict[str, dict[str, float]]:
        """axis -> value -> the share a draw is expected to have (what ``sample`` draws from)."""
        probs = self.corpus_probs(mix, corpus)
        nd = len(self.domains)
        out: dict[str, dict[str, float]] = {
            "corpus_kind": dict(probs),
            "domain": {d: 1.0 / nd for d in sorted(self.domains)},
            "skill_type": {},
            "command_complexity": {c: 1.0 / len(self.command_complexity) for c in self.command_complexity},
            "language": dict(self.languages),
        }
        for d in self.domains.values():
            for st in d.skill_types:
                key = f"{d.name}/{st}"
                out["skill_type"][key] = 1.0 / nd / len(d.skill_types)
        for ax in MIXED_AXES:
            shares: dict[str, float] = {}
            for c, pc in probs.items():
                for v, p in self.corpus_axes[c][ax].items():
                    shares[v] = shares.get(v, 0.0) + pc * p
            out[ax] = shares
        return out


def spec_axis_value(spec: TaskSpec | Mapping[str, Any], axis: str) -> str:
    """The value of ``axis`` for share counting (skill types are counted within their domain)."""
    d = spec.to_json() if isinstance(spec, TaskSpec) else spec
    return f"{d['domain']}/{d['skill_type']}" if axis == "skill_type" else str(d[axis])


def _weighted(rng: random.Random, probs: Mapping[str, float]) -> str:
    items = [(k, p) for k, p in probs.items() if p > 0]
    u, acc = rng.random() * sum(p for _, p in items), 0.0
    for k, p in items:
        acc += p
        if u < acc:
            return k
    return items[-1][0]


# ---------------------------------------------------------------------------------------------- loading
def load_taxonomy(path: str | Path | None = None) -> Taxonomy:
    """Read and check a taxonomy YAML; every error names the file and the field."""
    p = Path(path) if path else DEFAULT_TAXONOMY
    if not p.is_file():
        hint = (" (the default is shared/datasets/tmax-taxonomy/taxonomy.yaml beside the checkout, or under "
                "$JAXRL_TERM_SHARED; give --taxonomy PATH or datagen.taxonomy=PATH)") if not path else ""
        raise TaxonomyError(f"taxonomy file {p} does not exist{hint}")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise TaxonomyError(f"{p}: not valid YAML: {e}") from e
    where = str(p)

    def need(d: Any, key: str, ctx: str, kind: type | tuple = (dict,)) -> Any:
        if not isinstance(d, dict) or key not in d:
            raise TaxonomyError(f"{where}: missing field {ctx}{key}")
        if not isinstance(d[key], kind):
            raise TaxonomyError(f"{where}: field {ctx}{key} must be a {kind}, got {type(d[key]).__name__}")
        return d[key]

    domains = {}
    for name, d in need(raw, "domains", "").items():
        ctx = f"domains.{name}."
        sts = need(d, "skill_types", ctx)
        if not sts:
            raise TaxonomyError(f"{where}: {ctx}skill_types is empty")
        skill_types = {}
        for st, prims in sts.items():
            if not isinstance(prims, list) or not prims or not all(isinstance(x, str) for x in prims):
                raise TaxonomyError(f"{where}: {ctx}skill_types.{st} must be a non-empty list of strings")
            skill_types[str(st)] = tuple(prims)
        personas = need(d, "personas", ctx, list)
        if not personas:
            raise TaxonomyError(f"{where}: {ctx}personas is empty")
        domains[str(name)] = Domain(str(name), str(need(d, "base_image", ctx, str)), skill_types, tuple(personas),
                                    tuple(d.get("real_software_anchors") or ()))
    if not domains:
        raise TaxonomyError(f"{where}: domains is empty")

    axes = need(raw, "axes", "")
    langs = need(axes, "languages", "axes.", list)
    weights = {}
    for i, lang in enumerate(langs):
        if not isinstance(lang, dict) or "name" not in lang or not isinstance(lang.get("weight"), (int, float)):
            raise TaxonomyError(f"{where}: axes.languages[{i}] needs a name and a numeric weight")
        weights[str(lang["name"])] = float(lang["weight"])
    total = sum(weights.values())
    if total <= 0:
        raise TaxonomyError(f"{where}: axes.languages weights sum to {total}")
    languages = {k: w / total for k, w in weights.items()}
    command = tuple(str(c["name"]) for c in need(axes, "command_complexity", "axes.", list))
    complexities = {str(c["name"]): bool(c.get("legacy", True)) for c in need(axes, "task_complexity", "axes.", list)}
    verifiers = {str(c["name"]): bool(c.get("legacy_default", False)) for c in need(axes, "verifier_kinds", "axes.", list)}
    fixtures = {str(c["name"]): bool(c.get("legacy_default", False)) for c in need(axes, "fixture_kinds", "axes.", list)}

    sampling = raw.get("sampling") or {}
    prim = sampling.get("primitive_skills") or {}
    count = (int(prim.get("count_min", 3)), int(prim.get("count_max", 5)))
    if not 1 <= count[0] <= count[1]:
        raise TaxonomyError(f"{where}: sampling.primitive_skills count_min/count_max = {count}")
    anchor_p = float((sampling.get("real_software_anchor") or {}).get("probability",
                                                                      axes.get("real_software_anchor_probability", 0)))

    mixing = need(raw, "legacy_v2_mixing", "")
    kinds = tuple(need(mixing, "corpus_kinds", "legacy_v2_mixing.", list))
    defaults = need(mixing, "legacy_defaults", "legacy_v2_mixing.")
    legacy_bucket = {
        "task_complexity": list(need(defaults, "task_complexity_pool", "legacy_v2_mixing.legacy_defaults.", list)),
        "verifier_kind": [str(need(defaults, "verifier_kind", "legacy_v2_mixing.legacy_defaults.", str))],
        "fixture_kind": [str(need(defaults, "fixture_kind", "legacy_v2_mixing.legacy_defaults.", str))],
    }
    new_buckets = need(mixing, "new_buckets", "legacy_v2_mixing.")
    known = {"task_complexity": complexities, "verifier_kind": verifiers, "fixture_kind": fixtures}
    for ax in MIXED_AXES:
        for v in legacy_bucket[ax] + list(new_buckets.get(ax) or []):
            if v not in known[ax]:
                raise TaxonomyError(f"{where}: legacy_v2_mixing names {ax} {v!r}, which axes does not define "
                                    f"(known: {sorted(known[ax])})")
    enabled = mixing.get("v2_axes_enabled") or {}
    multipliers = mixing.get("multipliers") or {}
    corpus_axes: dict[str, dict[str, dict[str, float]]] = {}
    for kind in kinds:
        mult = multipliers.get(kind)
        per = {}
        for ax in MIXED_AXES:
            legacy = legacy_bucket[ax]
            if not enabled.get(kind, mult is not None) or mult is None:
                per[ax] = {v: 1.0 / len(legacy) for v in legacy}
                continue
            if ax not in mult:
                raise TaxonomyError(f"{where}: legacy_v2_mixing.multipliers.{kind} has no {ax}")
            m = float(mult[ax])
            new = list(new_buckets.get(ax) or [])
            if m < 0 or (m > 0 and not new):
                raise TaxonomyError(f"{where}: legacy_v2_mixing.multipliers.{kind}.{ax} = {m} (needs >= 0 and a new "
                                    f"bucket for {ax})")
            p_new = 1.0 if math.isinf(m) else m / (m + 1.0)
            dist = {v: (1.0 - p_new) / len(legacy) for v in legacy}
            for v in new:
                dist[v] = dist.get(v, 0.0) + p_new / len(new)
            per[ax] = dist
        corpus_axes[kind] = per
    _check_derived(where, mixing.get("derived_sampling_probabilities") or {}, corpus_axes)

    mixes = {}
    for key, sec in raw.items():
        if isinstance(sec, dict) and isinstance(sec.get("parts"), list):
            counts: dict[str, float] = {}
            for j, part in enumerate(sec["parts"]):
                if not isinstance(part, dict) or part.get("corpus_kind") not in kinds:
                    raise TaxonomyError(f"{where}: {key}.parts[{j}].corpus_kind must be one of {list(kinds)}")
                n = part.get("surviving", part.get("requested"))
                if not isinstance(n, (int, float)) or n < 0:
                    raise TaxonomyError(f"{where}: {key}.parts[{j}] needs a count (surviving or requested)")
                counts[part["corpus_kind"]] = counts.get(part["corpus_kind"], 0.0) + float(n)
            tot = sum(counts.values())
            if tot > 0:
                mixes[str(key)] = {k: c / tot for k, c in counts.items()}

    routing = mixing.get("base_image_routing") or {}
    intricate = routing.get("intricate_image") if routing.get("intricate_if_any_non_legacy_axis") else None
    legacy_values = {ax: frozenset(legacy_bucket[ax]) for ax in MIXED_AXES}
    return Taxonomy(where, domains, languages, command, count, anchor_p, kinds, corpus_axes, legacy_values,
                    intricate, mixes)


def _check_derived(where: str, derived: Mapping, computed: Mapping) -> None:
    """The file's own derived probabilities must equal the rule's (a file that contradicts itself is refused)."""
    for kind, axes in derived.items():
        for ax, values in (axes or {}).items():
            if kind not in computed or ax not in computed[kind]:
                continue
            for v, p in values.items():
                got = computed[kind][ax].get(v, 0.0)
                if abs(got - float(p)) > 2e-3:
                    raise TaxonomyError(f"{where}: legacy_v2_mixing.derived_sampling_probabilities.{kind}.{ax}.{v} = "
                                        f"{p}, but the bucket rule with the file's multipliers gives {got:.4f}")


def share_table(specs: Sequence[TaskSpec | Mapping[str, Any]], expected: Mapping[str, Mapping[str, float]]
                ) -> list[tuple[str, str, int, float, float]]:
    """(axis, value, count, observed share, target share) for every axis and value of ``expected``."""
    n = max(1, len(specs))
    rows = []
    for axis, target in expected.items():
        counts: dict[str, int] = {}
        for s in specs:
            v = spec_axis_value(s, axis)
            counts[v] = counts.get(v, 0) + 1
        for v in sorted(set(target) | set(counts)):
            rows.append((axis, v, counts.get(v, 0), counts.get(v, 0) / n, target.get(v, 0.0)))
    return rows
