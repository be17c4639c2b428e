"""Streaming parsers: complete pieces come out as soon as they are complete."""

from __future__ import annotations

import pytest

from headrace.graph.parsers import JsonListParser, LineParser, clean_item, make_parser


def feed_all(parser, chunks):
    """Pieces emitted after each chunk, then those from finish()."""
    return [parser.feed(c) for c in chunks], parser.finish()


def test_line_parser_emits_a_line_when_its_newline_arrives():
    p = LineParser()
    assert p.feed("first que") == []
    assert p.feed("ry") == []
    assert p.feed("\nsec") == ["first query"]
    assert p.feed("ond\nthird\n") == ["second", "third"]
    assert p.feed("tail") == []
    assert p.finish() == ["tail"]
    assert p.finish() == []  # the tail is flushed once


def test_line_parser_strips_numbering_bullets_quotes_and_blank_lines():
    chunks = ["1. alpha\n", "2) beta\n\n", "- gamma\n", "* delta\n", "• eps", "ilon\n", "(3) zeta\n",
              "a) eta\n", '"theta"\n', "   \n", "  iota  "]
    per_chunk, tail = feed_all(LineParser(), chunks)
    pieces = [x for batch in per_chunk for x in batch] + tail
    assert pieces == ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota"]


def test_line_parser_keeps_numbers_that_are_not_markers():
    assert clean_item("2024 results") == "2024 results"
    assert clean_item("3.5 stars") == "3.5 stars"
    assert clean_item("10. ten") == "ten"


def test_line_parser_finish_with_nothing_left():
    p = LineParser()
    assert p.feed("one\n") == ["one"]
    assert p.finish() == []


def test_json_list_items_emitted_as_each_completes():
    p = JsonListParser()
    assert p.feed("Sure! Here") == []
    assert p.feed(' they are: ["al') == []
    assert p.feed('pha", "be') == ["alpha"]
    assert p.feed('ta", ') == ["beta"]
    assert p.feed('"gam') == []
    assert p.feed('ma"]') == ["gamma"]
    assert p.feed(' and "after" the list') == []
    assert p.finish() == []


def test_json_list_one_character_at_a_time():
    text = '["one", "two, three", "fo\\"ur", "", "  five  ", 6, "six"] "seven"'
    p = JsonListParser()
    pieces = []
    for ch in text:
        pieces += p.feed(ch)
    assert pieces == ["one", "two, three", 'fo"ur', "five", "six"]
    assert p.finish() == []


def test_json_list_split_inside_an_escape():
    p = JsonListParser()
    assert p.feed('["a\\') == []
    assert p.feed('"b", "c\\u00e9') == ['a"b']
    assert p.feed('"]') == ["c\u00e9"]


def test_json_list_never_closed_still_yields_complete_items():
    p = JsonListParser()
    out = p.feed('["first", "second", "thi')
    assert out == ["first", "second"]
    assert p.finish() == []  # the incomplete item is dropped


def test_json_without_a_list_falls_back_to_lines():
    p = JsonListParser()
    assert p.feed("1. first query\n2. sec") == []
    assert p.feed("ond query") == []
    assert p.finish() == ["first query", "second query"]


@pytest.mark.parametrize("kind,cls", [("lines", LineParser), ("json", JsonListParser)])
def test_make_parser(kind, cls):
    assert isinstance(make_parser(kind), cls)


def test_make_parser_unknown_kind():
    with pytest.raises(ValueError, match="xml"):
        make_parser("xml")


def test_a_json_splittable_decode_is_constrained_to_a_list_of_short_strings():
    import json

    import jsonschema

    from headrace.graph.graph import Node, Op
    from headrace.graph.ops import sampling

    node = Node("claims", Op.DECODE, engine="lm", inputs=("ctx",), outputs=("claims",), splittable="json")
    node.params["max_pieces"] = 3
    schema = json.loads(sampling(node).constraint.schema)
    jsonschema.validate(["a", "b"], schema)
    for bad in ([], ["a", "b", "c", "d"], [1], [""]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    lines = Node("q", Op.DECODE, engine="lm", inputs=("ctx",), outputs=("q",), splittable="lines")
    assert sampling(lines).constraint is None
