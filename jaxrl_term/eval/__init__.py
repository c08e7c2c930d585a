"""Evaluation: pass@k of any policy on any task source (``python -m jaxrl_term.eval``), and the held-out
evaluation during training. See ``core`` (the evaluator, pass@k) and ``run`` (from config)."""

from jaxrl_term.eval.core import EvalSettings, Evaluator, failure_mode, pass_at_k, summarize

__all__ = ["EvalSettings", "Evaluator", "failure_mode", "pass_at_k", "summarize"]
