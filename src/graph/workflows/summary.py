"""map_reduce_summary and chain_summary (Parrot §8.2's summaries of a long document).

Both chunk the document at build time to know how many LLM calls to emit: one
CHUNK primitive at run time, then a FUNCTION that spreads the chunks over one
variable each.

- map_reduce_summary: one independent "map" summary per chunk (they batch in
  the LLM engine), then "reduce" calls that combine the partial summaries,
  ``fan_in`` at a time, level by level, until one summary remains.
- chain_summary: step 0 summarizes the first chunk; step i rewrites the
  summary so far together with chunk i, so the steps run one after another by
  data dependency alone (Parrot's server-side chaining).
"""

from __future__ import annotations

from typing import Any, Mapping

from headrace.graph.components import Component, GraphBuilder, Template
from headrace.graph.workflow import Workflow
from headrace.graph.workflows.common import SUMMARY_MAX_TOKENS, count_chunks, max_tokens_option, split_list

DOCUMENT = {"type": "string", "minLength": 1, "description": "the text to summarize"}

SUMMARY_CONFIG = {
    "chunk_size": {"type": "integer", "minimum": 16, "maximum": 1024, "default": 256,
                   "description": "words per chunk"},
    "chunk_overlap": {"type": "integer", "minimum": 0, "maximum": 1023, "default": 0, "description": "words shared by neighbours"},
    "max_tokens": max_tokens_option(SUMMARY_MAX_TOKENS, "tokens per summary (each map, reduce or chain step)"),
}

chunk = Component("chunk", "chunk", inputs=("document",), outputs=("chunks",))


def _chunk(b: GraphBuilder, inputs: dict[str, Any], config: dict[str, Any]) -> tuple[int, Component]:
    """Emit the chunking and the spread of chunks over ``chunks_0..chunks_{n-1}``; returns (n, spread)."""
    n = count_chunks(inputs, "document", config)
    b.emit(chunk, size=n, words=config["chunk_size"], overlap=config["chunk_overlap"])
    spread = split_list("spread", "chunks", n)
    b.emit(spread)
    return n, spread


# map-reduce ---------------------------------------------------------------------------

MAP = ("Summarize this part of a document in one or two sentences.\n"
       "Text: {{input:chunk}}\nSummary: {{output:summary}}")
REDUCE_HEAD = "Combine these summaries of the parts of one document into one short summary.\n"

map_ = Component("map", "llm", prompt=MAP)


def build_map_reduce(inputs: dict[str, Any], config: dict[str, Any], engines: Mapping[str, str]):
    b = GraphBuilder("map_reduce_summary", engines)
    n, spread = _chunk(b, inputs, config)
    llm = {"max_tokens": config["max_tokens"]}
    level = [f"summary_{i}" if n > 1 else "summary" for i in range(n)]
    for i in range(n):
        b.emit(map_, suffix=f"_{i}", rename={"chunk": f"chunks_{i}", "summary": level[i]}, **llm)
    # Tree reduce: fan_in partial summaries per call, level by level; the last call writes "summary".
    fan_in, depth = config["fan_in"], 0
    while len(level) > 1:
        groups = [level[i : i + fan_in] for i in range(0, len(level), fan_in)]
        nxt = []
        for g, group in enumerate(groups):
            last = len(groups) == 1
            out = "summary" if last else f"reduced_{depth}_{g}"
            body = "".join(f"Part {j + 1}: {{{{input:{v}}}}}\n" for j, v in enumerate(group))
            name = "reduce" if last else f"reduce_{depth}_{g}"
            b.emit(Component(name, "llm", prompt=REDUCE_HEAD + body + f"Summary: {{{{output:{out}}}}}"), **llm)
            nxt.append(out)
        level, depth = nxt, depth + 1
    return b.finish(Template([chunk, spread, map_]))


MAP_REDUCE = Workflow(
    name="map_reduce_summary",
    description="Summarize each chunk of a document independently (batched), then combine the partial "
                "summaries fan_in at a time until one remains.",
    inputs={"document": DOCUMENT},
    required=("document",),
    config={**SUMMARY_CONFIG,
            "fan_in": {"type": "integer", "minimum": 2, "maximum": 32, "default": 8,
                       "description": "partial summaries combined per reduce call"}},
    build=build_map_reduce,
    outputs=("summary",),
    kinds=("llm",),
)


# chain --------------------------------------------------------------------------------

FIRST = ("Summarize this text in two or three sentences.\n"
         "Text: {{input:chunk}}\nSummary: {{output:summary}}")
UPDATE = ("Here is a summary of a document so far and the next part of the document. "
          "Write one short summary that covers both.\n"
          "Summary so far: {{input:previous}}\nNext part: {{input:chunk}}\nUpdated summary: {{output:summary}}")

first = Component("step_0", "llm", prompt=FIRST)
update = Component("step", "llm", prompt=UPDATE)


def build_chain(inputs: dict[str, Any], config: dict[str, Any], engines: Mapping[str, str]):
    b = GraphBuilder("chain_summary", engines)
    n, spread = _chunk(b, inputs, config)
    llm = {"max_tokens": config["max_tokens"]}
    out = [f"summary_{i}" for i in range(n - 1)] + ["summary"]
    b.emit(first, rename={"chunk": "chunks_0", "summary": out[0]}, **llm)
    for i in range(1, n):
        b.emit(update, suffix=f"_{i}", rename={"previous": out[i - 1], "chunk": f"chunks_{i}", "summary": out[i]},
               **llm)
    return b.finish(Template([chunk, spread, first, update]))


CHAIN = Workflow(
    name="chain_summary",
    description="Summarize a document chunk by chunk: each step rewrites the summary so far with the next "
                "chunk, so the steps run strictly in sequence.",
    inputs={"document": DOCUMENT},
    required=("document",),
    config=dict(SUMMARY_CONFIG),
    build=build_chain,
    outputs=("summary",),
    kinds=("llm",),
)
