"""Does making a policy's own successful episodes more likely on some tasks make its successes on OTHER tasks
more likely? The question behind "RL does not lift held-out pass@1": a positive-only policy-gradient step on
successful episodes is a likelihood step on them, so if the likelihood does not carry over to other tasks'
successes, neither can the RL update.

Takes the successful attempts of one evaluation (``jaxrl_term.eval`` or a train run's ``eval/step_N``), splits
their tasks in two halves (every other task id, sorted), takes optimizer steps that raise the mean per-token
log-probability of the first half's episodes (policy tokens only, one sequence-mean per episode, like
``algo.aggregation=seq-mean-token-mean``, gradient clipped at 1.0 as in ``conf/optim/adamw.yaml``), and reports
the change of that log-probability on both halves and the per-token entropy on the second.

It runs on transformers + torch (the CPU test reference), independently of the trainer, so the answer is about
the policy and the data, not about our update code.

    .venv/bin/python experiments/learning_curve/transfer_probe.py --model runs/v9/sft/hf_final \\
        --eval runs/pilot/eps_lr1e3/eval/step_000000 [--out table.md]
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

OPTIMIZERS = {  # name -> (torch optimizer, kwargs)
    "AdamW lr 3e-5": ("AdamW", {"lr": 3e-5, "weight_decay": 0.01}),
    "AdamW lr 1e-4": ("AdamW", {"lr": 1e-4, "weight_decay": 0.01}),
    "AdamW lr 3e-4": ("AdamW", {"lr": 3e-4, "weight_decay": 0.01}),
    "AdamW lr 1e-3": ("AdamW", {"lr": 1e-3, "weight_decay": 0.01}),
    "AdamW lr 1e-3 eps 1e-3": ("AdamW", {"lr": 1e-3, "eps": 1e-3, "weight_decay": 0.01}),
    "SGD lr 0.03": ("SGD", {"lr": 0.03}),
    "SGD lr 0.1": ("SGD", {"lr": 0.1}),
    "SGD lr 0.3": ("SGD", {"lr": 0.3}),
    "SGD lr 1": ("SGD", {"lr": 1.0}),
}


def successes(eval_dir: Path) -> list[dict]:
    """The token records (``tokens.jsonl``) of the passed attempts of an evaluation directory."""
    attempts = eval_dir / "attempts.jsonl"
    tokens = eval_dir / "tokens.jsonl"
    for p in (attempts, tokens):
        if not p.exists():
            raise SystemExit(f"--eval {eval_dir}: no {p.name}; give an evaluation directory of jaxrl_term.eval or a "
                             f"train run's eval/step_N")
    passed = {r["id"] for r in map(json.loads, attempts.read_text().splitlines()) if r.get("pass")}
    return [t for t in map(json.loads, tokens.read_text().splitlines()) if t["id"] in passed]


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF checkpoint directory (a run's hf_final)")
    ap.add_argument("--eval", required=True, help="an evaluation directory with attempts.jsonl and tokens.jsonl")
    ap.add_argument("--steps", default="1,4,12", help="optimizer steps, comma-separated")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="names from OPTIMIZERS, comma-separated")
    ap.add_argument("--out", help="write the markdown table here as well")
    args = ap.parse_args()

    torch.manual_seed(0)
    succ = successes(Path(args.eval))
    tasks = sorted({t["task"] for t in succ})
    first = set(tasks[::2])
    a = [t for t in succ if t["task"] in first]
    b = [t for t in succ if t["task"] not in first]
    if not a or not b:
        raise SystemExit(f"--eval {args.eval}: {len(succ)} successful attempt(s) of {len(tasks)} task(s); the probe "
                         f"needs successes on at least 2 tasks")
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    def stats(model, records):
        """Per episode: mean log-prob and mean entropy over its policy tokens."""
        lps, ents = [], []
        for t in records:
            ids = torch.tensor([t["token_ids"]])
            mask = torch.tensor(t["loss_mask"][1:], dtype=torch.float32)
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            tok = logp.gather(-1, ids[0, 1:, None])[:, 0]
            ent = -(logp.exp() * logp).sum(-1)
            lps.append((tok * mask).sum() / mask.sum())
            ents.append((ent * mask).sum() / mask.sum())
        return torch.stack(lps), torch.stack(ents)

    with torch.no_grad():
        a0, _ = stats(base, a)
        b0, eb0 = stats(base, b)
    lines = [f"Successful episodes: {len(a)} on {len(first)} tasks stepped on, {len(b)} on "
             f"{len(tasks) - len(first)} other tasks. Mean per-token log-prob at the start: {a0.mean():.4f} / "
             f"{b0.mean():.4f}; per-token entropy on the other tasks' episodes {eb0.mean():.4f}.", "",
             "| optimizer | steps | update norm | change of log-prob, tasks stepped on | change of log-prob, other "
             "tasks | entropy, other tasks |", "| --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for name in args.optimizers.split(","):
        kind, kw = OPTIMIZERS[name]
        for steps in map(int, args.steps.split(",")):
            model = copy.deepcopy(base)
            opt = getattr(torch.optim, kind)(model.parameters(), **kw)
            before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
            for _ in range(steps):
                opt.zero_grad()
                lp, _ = stats(model, a)
                (-lp.mean()).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
            moved = (torch.cat([p.detach().flatten() for p in model.parameters()]) - before).norm()
            with torch.no_grad():
                a1, _ = stats(model, a)
                b1, eb1 = stats(model, b)
            row = (f"| {name} | {steps} | {moved:.3f} | {(a1 - a0).mean():+.4f} | {(b1 - b0).mean():+.4f} | "
                   f"{eb1.mean():.4f} |")
            lines.append(row)
            print(row, flush=True)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
