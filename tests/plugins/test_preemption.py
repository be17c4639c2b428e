"""Which decoding rows pause for more urgent work, and when they come back (``preemption``), on the core's rows.

The rows are the cores' own ``Row`` records (their model-side fields unused here); the real engine's
pauses are in test_llama_cpp.py."""

from __future__ import annotations

from headrace.plugins.engines.llm.core import Row
from headrace.plugins.engines.llm.preemption import PausedRows, Want, choose
from headrace.plugins.protocols import SamplingParams


def row(name: str, priority: int, preemptive: bool = True) -> Row:
    return Row(ctx=name, params=SamplingParams(), send=None, free_after=False, priority=priority, generator=None,
               detok=None, length=10, preemptive=preemptive)


def running(rows, paused=(), wants=(), row_limit=4, token_budget=8, max_pause=10.0) -> list[str]:
    """The rows (of ``rows`` and ``paused``) that run this iteration, by name."""
    keep = choose(rows, list(paused), list(wants), row_limit=row_limit, token_budget=token_budget, now=0.0,
                  max_pause=max_pause)
    return sorted(r.ctx for r in [*rows, *paused] if id(r) in keep)


def test_a_decode_waiting_for_a_row_slot_pauses_the_least_urgent_preemptive_row():
    rows = [row("a", 5), row("b", 9), row("c", 7), row("plain", 99, preemptive=False)]
    # The four slots are full: a more urgent decode waiting to join takes the slot of the least urgent
    # preemptive row (b), never the slot of one that is not preemptive.
    assert running(rows, wants=[Want(1, 1, 1)]) == ["a", "c", "plain"]
    # Two of them: c goes too; one of the same rank as a row pauses nothing.
    assert running(rows, wants=[Want(1, 1, 1), Want(2, 1, 1)]) == ["a", "plain"]
    assert running(rows, wants=[Want(9, 1, 1)]) == ["a", "b", "c", "plain"]
    # With a free slot nothing pauses.
    assert running(rows[:3], wants=[Want(1, 1, 1)]) == ["a", "b", "c"]


def test_a_prefill_pauses_rows_only_as_far_as_its_tokens_need():
    rows = [row("a", 5), row("b", 9), row("c", 7)]
    assert running(rows, wants=[Want(1, 0, 6)]) == ["a", "c"]  # 8 tokens: 6 for it, 2 for the most urgent rows
    assert running(rows, wants=[Want(1, 0, 100)]) == []  # it takes the whole budget
    assert running(rows, wants=[Want(6, 0, 100)]) == ["a"]  # only rows of a lower rank pause
    assert running(rows, wants=[Want(1, 0, 5)]) == ["a", "b", "c"]


def test_rows_resume_once_the_urgent_work_is_in_and_an_overdue_row_goes_first():
    a, b = row("a", 5), row("b", 9)
    paused = PausedRows(max_pause=10.0)
    left = paused.update([a, b], [Want(1, 0, 100)], row_limit=4, token_budget=8)
    assert left == [] and paused.rows == [a, b] and paused.pauses == 2 and a.paused_at is not None
    # The prefill is in: both come back, the same objects, with their time paused counted.
    back = paused.update([], [], row_limit=4, token_budget=8)
    assert back == [a, b] and not paused.rows and a.paused_at is None and a.paused_for >= 0.0
    # A row paused max_pause seconds in all is overdue: it runs ahead of more urgent work and of more
    # urgent rows, and is never paused again.
    b.paused_for = 10.0
    assert running([a, b], row_limit=1, wants=[Want(1, 1, 1)]) == ["b"]
    assert running([a, b], wants=[Want(1, 0, 100)]) == ["b"]
    assert running([a], paused=[b], row_limit=1) == ["b"]


def test_work_that_is_not_preemptive_neither_pauses_nor_is_paused():
    plain = [row("x", 9, preemptive=False), row("y", 9, preemptive=False)]
    paused = PausedRows()
    assert paused.update(plain, [Want(1, 0, 100), Want(1, 1, 1)], row_limit=2, token_budget=8) == plain
    assert paused.pauses == 0
