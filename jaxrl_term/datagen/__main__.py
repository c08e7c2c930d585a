"""``python -m jaxrl_term.datagen sample|run|report``.

    sample --n N --seed S [--mix tmax_15k | --corpus legacy|sft_v2|rl_v2] [--taxonomy PATH] [--out specs.jsonl]
        draw task specs; prints each axis's distribution against the taxonomy's target shares
    run +datagen=NAME [datagen.key=value ...]
        generate, validate and export tasks (Hydra; resumable in datagen.out_dir)
    report OUT_DIR
        rewrite OUT_DIR/report.md and report.png from OUT_DIR/records.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path


def cmd_sample(argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from jaxrl_term.datagen.taxonomy import TaxonomyError, load_taxonomy, share_table

    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.datagen sample")
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--mix", default=None, help="corpus mix (default tmax_15k)")
    g.add_argument("--corpus", default=None, help="one corpus kind: legacy, sft_v2 or rl_v2")
    ap.add_argument("--taxonomy", default=None, help="taxonomy YAML (default: ../shared/datasets/tmax-taxonomy)")
    ap.add_argument("--out", default=None, help="write one spec per line (JSON) here")
    args = ap.parse_args(argv)
    if args.n < 1:
        print("error: --n must be >= 1", file=sys.stderr)
        return 2
    try:
        tax = load_taxonomy(args.taxonomy)
        specs = tax.sample(args.n, args.seed, mix=args.mix, corpus=args.corpus)
        expected = tax.expected_shares(args.mix, args.corpus)
    except TaxonomyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for s in specs:
                f.write(json.dumps(s.to_json()) + "\n")
    table = Table(title=f"{args.n} specs, seed {args.seed}, "
                        f"{'corpus ' + args.corpus if args.corpus else 'mix ' + (args.mix or 'tmax_15k')}")
    for col in ("axis", "value", "count", "share", "target"):
        table.add_column(col, justify="right" if col in ("count", "share", "target") else "left")
    for axis, value, n, share, target in share_table(specs, expected):
        if axis == "skill_type":
            continue  # 52 rows; counted per domain in specs.jsonl
        table.add_row(axis, value, str(n), f"{share:.3f}", f"{target:.3f}")
    Console(width=140).print(table)
    if args.out:
        print(f"wrote {len(specs)} specs to {args.out}")
    return 0


def compose(overrides: list[str]):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from jaxrl_term.config import register
    from jaxrl_term.train import CONF_DIR

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose("datagen_config", overrides=list(overrides))


def problems(cfg) -> list[str]:
    d = cfg.datagen
    out = []
    if not d.teacher.endpoints:
        out.append("datagen.teacher.endpoints: empty; list at least one OpenAI-compatible endpoint (see "
                   "conf/datagen/example.yaml)")
    if d.mix and d.corpus:
        out.append("datagen.mix and datagen.corpus: set one (datagen.mix=null datagen.corpus=rl_v2)")
    if d.n < 1 and not d.specs:
        out.append(f"datagen.n={d.n}: must be >= 1")
    if d.max_repairs < 0:
        out.append(f"datagen.max_repairs={d.max_repairs}: must be >= 0")
    if not 0 < d.dedup_threshold <= 1:
        out.append(f"datagen.dedup_threshold={d.dedup_threshold}: must be in (0, 1]")
    if d.specs and not Path(d.specs).is_file():
        out.append(f"datagen.specs={d.specs}: no such file (write one with `python -m jaxrl_term.datagen sample "
                   "--out FILE`)")
    if d.scoring not in ("weighted", "binary"):
        out.append(f"datagen.scoring={d.scoring!r}: weighted or binary")
    lo, hi = (list(d.pass_rate.band) + [None, None])[:2]
    if d.pass_rate.enabled and (lo is None or hi is None or not 0 <= lo <= hi <= 1):
        out.append(f"datagen.pass_rate.band={list(d.pass_rate.band)}: [lo, hi] with 0 <= lo <= hi <= 1")
    for i, ep in enumerate(d.teacher.endpoints):
        import os

        if ep.api_key_env and not os.environ.get(ep.api_key_env):
            out.append(f"datagen.teacher.endpoints[{i}].api_key_env: {ep.api_key_env} is not set in the environment")
    return out


def cmd_run(argv: list[str]) -> int:
    from omegaconf import OmegaConf

    from jaxrl_term.datagen.run import run_datagen

    try:
        cfg = compose(argv)
    except Exception as e:  # noqa: BLE001 - Hydra's composition errors, shown as config errors
        print(f"config error: {e}", file=sys.stderr)
        return 2
    bad = problems(cfg)
    if bad:
        print("config error:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = Path(cfg.datagen.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "datagen_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
    summary = asyncio.run(run_datagen(cfg))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_axis"}, indent=2))
    return 0


def cmd_report(argv: list[str]) -> int:
    from jaxrl_term.datagen.report import write_report

    ap = argparse.ArgumentParser(prog="python -m jaxrl_term.datagen report")
    ap.add_argument("out_dir")
    args = ap.parse_args(argv)
    print(f"wrote {write_report(args.out_dir)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmds = {"sample": cmd_sample, "run": cmd_run, "report": cmd_report}
    if not argv or argv[0] not in cmds:
        print(__doc__, file=sys.stderr)
        return 2
    return cmds[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
