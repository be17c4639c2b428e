"""Prompt templates: placeholders, rendering, the prefix split, prefix hashes."""

from __future__ import annotations

import pytest

from headrace.graph.prompts import PromptTemplate

ANSWER = ("Answer the question using the context.\nQuestion: {{input:question}}\n"
          "Context:\n{{input:context}}\nAnswer: {{output:answer}}")


def test_inputs_in_order_of_first_use_and_the_output():
    t = PromptTemplate("{{input:b}} and {{input:a}} then {{input:b}} again: {{output:out}}")
    assert t.inputs == ("b", "a")
    assert t.output == "out"


def test_no_placeholders():
    t = PromptTemplate("just text")
    assert t.inputs == ()
    assert t.output is None
    assert t.render({}) == "just text"
    assert t.split(set()) == ("just text", "")


def test_malformed_placeholders_are_plain_text():
    t = PromptTemplate("{{input:1bad}} {{inputs:x}} {{input: y}} {{output:ok}}")
    assert t.inputs == ()
    assert t.output == "ok"


def test_render_fills_inputs_and_drops_the_output_placeholder():
    t = PromptTemplate(ANSWER)
    text = t.render({"question": "Why?", "context": ["first", "second"]})
    assert text == "Answer the question using the context.\nQuestion: Why?\nContext:\nfirst\n\nsecond\nAnswer:"
    assert "{{" not in text


def test_render_stringifies_values_and_ignores_extra_ones():
    t = PromptTemplate("n={{input:n}} {{output:x}}")
    assert t.render({"n": 3, "unused": "zzz"}) == "n=3"


def test_render_missing_input_names_it():
    with pytest.raises(KeyError, match="context"):
        PromptTemplate(ANSWER).render({"question": "Why?"})


def test_split_at_the_first_unavailable_input():
    t = PromptTemplate(ANSWER)
    prefix, rest = t.split({"question"})
    assert prefix == "Answer the question using the context.\nQuestion: {{input:question}}\nContext:\n"
    assert rest == "{{input:context}}\nAnswer: {{output:answer}}"
    assert prefix + rest == ANSWER
    assert PromptTemplate(prefix).inputs == ("question",)
    assert PromptTemplate(rest).inputs == ("context",)
    assert PromptTemplate(rest).output == "answer"


def test_split_with_nothing_available_stops_at_the_first_input():
    prefix, rest = PromptTemplate(ANSWER).split(set())
    assert prefix == "Answer the question using the context.\nQuestion: "
    assert PromptTemplate(rest).inputs == ("question", "context")


def test_split_with_everything_available_stops_at_the_output():
    prefix, rest = PromptTemplate(ANSWER).split({"question", "context"})
    assert rest == "{{output:answer}}"
    assert PromptTemplate(rest).inputs == ()
    assert PromptTemplate(prefix).inputs == ("question", "context")


def test_split_skips_available_inputs_past_a_missing_one():
    t = PromptTemplate("A {{input:a}} B {{input:b}} C {{input:c}} {{output:o}}")
    prefix, rest = t.split({"a", "c"})
    assert prefix == "A {{input:a}} B "
    assert PromptTemplate(rest).inputs == ("b", "c")


def test_two_outputs_are_rejected():
    with pytest.raises(ValueError, match="at most one"):
        PromptTemplate("{{output:a}} {{output:b}}")


def test_output_must_end_the_prompt():
    with pytest.raises(ValueError, match="must end the prompt"):
        PromptTemplate("Answer: {{output:a}} and then {{input:b}}")
    # Trailing whitespace after the output is fine.
    assert PromptTemplate("Answer: {{output:a}}\n  ").output == "a"


def test_prefix_hash_depends_only_on_the_static_prefix():
    a = PromptTemplate("System: be brief.\nQ: {{input:question}}\nA: {{output:answer}}")
    b = PromptTemplate("System: be brief.\nQ: {{input:other}}\nContext {{input:c}}\nA: {{output:x}}")
    c = PromptTemplate("System: be verbose.\nQ: {{input:question}}\nA: {{output:answer}}")
    assert a.prefix_hash() == PromptTemplate(a.text).prefix_hash()  # stable
    assert a.prefix_hash() == b.prefix_hash()
    assert a.prefix_hash() != c.prefix_hash()
    assert len(a.prefix_hash()) == 12


def test_prefix_hash_without_placeholders_hashes_everything():
    assert PromptTemplate("abc").prefix_hash() != PromptTemplate("abd").prefix_hash()
    assert PromptTemplate("abc").prefix_hash() == PromptTemplate("abc{{input:x}}").prefix_hash()


def test_a_prompts_documents_are_tokenized_alone_where_they_stand():
    """What a workflow with ``place_documents`` sends: each retrieved document's tokens are the document's own
    (as its KV was computed at ingest), at the span the prompt says; the rest is the prompt's text."""
    import types

    from headrace.graph.graph import Node, Op
    from headrace.graph.prompts import prompt_documents, prompt_tokens
    from headrace.graph.workflows.common import ONE_SHOT
    from headrace.plugins.engines.llama_cpp.files import default_cache_dir, load_tokenizer
    from headrace.plugins.engines.llama_cpp.options import DEFAULT_MODEL
    from headrace.plugins.engines.llm.front import LLMFront
    from headrace.plugins.engines.models.paths import resolve_model

    engine = LLMFront("m", types.SimpleNamespace(tokenizer=load_tokenizer(resolve_model(DEFAULT_MODEL),
                                                                          default_cache_dir())))
    docs = ["The weir holds the river back.", "", "Locks lift boats between levels."]
    node = Node("answer.prefill", Op.PREFILL, params={"prompt": ONE_SHOT, "placed_documents": "contexts"})
    scope = {"question": "What holds the river?", "contexts": docs}
    tokens, spans = prompt_documents(engine, node, scope, "all")
    assert [tokens[s:s + n] for s, n in spans] == [engine.encode(docs[0]), engine.encode(docs[2])]  # "" is none
    text = engine.tokenizer.decode  # the same text, tokenized in pieces
    assert text(tokens) == text(prompt_tokens(engine, node, scope, "all"))
    one = {"question": "Why?", "context": docs[2]}  # a single text is one document
    leaf = Node("leaf.prefill", Op.PREFILL, params={"prompt": ANSWER, "placed_documents": "context"})
    tokens, spans = prompt_documents(engine, leaf, one, "all")
    assert len(spans) == 1 and tokens[spans[0][0]:sum(spans[0])] == engine.encode(docs[2])
