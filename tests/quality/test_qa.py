"""The task score: SQuAD's normalization and token F1, and questions drawn from real docstrings."""

from __future__ import annotations

import pytest

from headrace.quality.qa import answer_text, exact_match, normalize, returns_items, token_f1


def test_answers_are_normalized_as_squad_does():
    assert normalize("The  Harmonic mean, of DATA!") == "harmonic mean of data"
    assert exact_match("the harmonic mean of data.", "Harmonic mean of data") == 1.0
    assert exact_match("the mean", "the median") == 0.0


def test_token_f1_counts_shared_tokens_both_ways():
    assert token_f1("harmonic mean of data", "the harmonic mean of data") == 1.0
    # 2 of 3 predicted tokens are gold (precision 2/3), 2 of 4 gold tokens found (recall 1/2): F1 4/7.
    assert token_f1("mean of numbers", "harmonic mean of data") == pytest.approx(4 / 7)
    assert token_f1("nothing shared", "harmonic mean") == 0.0
    assert token_f1("", "") == 1.0 and token_f1("", "x") == 0.0


def test_the_first_line_is_the_answer():
    assert answer_text("\n  It returns the mean.  \nMore text") == "It returns the mean."
    assert answer_text("") == ""


def test_questions_come_from_docstrings_that_say_what_they_return():
    sections = [("json", "json: a module"), ("m.f", "m.f: Return the index where to insert x. More."),
                ("m.g", "m.g: Returns it."), ("m.h", "m.h: Compute something. Return later.")]
    items = returns_items(sections)
    assert [(i.topic, i.question, i.gold) for i in items] == [
        ("m.f", "What does m.f return?", "the index where to insert x")]
    assert items[0].gold in items[0].section
