"""Driving a GPU engine step by step in tests (import from here)."""

from __future__ import annotations


def next_plan_with_prompt_rows(eng, tries: int = 200):
    """The engine's next scheduled plan that holds prompt rows, not yet run; the plans before it are run (decoding
    the running requests while a new request's adapter loads). Its prompt rows are the requests submitted last."""
    plan = None
    for _ in range(tries):
        eng._drain_inbox()
        plan = eng.batcher.schedule()
        if plan.prefill_tokens:
            return plan
        eng.run_plan(plan)
    return plan
