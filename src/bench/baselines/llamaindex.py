"""naive_rag and advanced_rag written with LlamaIndex as a client of the daemon (Ayo's baseline).

The pipelines are what a LlamaIndex user would write against an OpenAI-compatible
server: ``OpenAILike`` and ``OpenAILikeEmbedding`` on the daemon's ``/v1``, an
in-memory ``VectorStoreIndex`` per run, a ``RetrieverQueryEngine`` whose modules
each wait for the previous one (retrieve, postprocess, synthesize), entered
through LlamaIndex's async API so that many runs can be in flight at once.

What is kept identical to headrace's workflows (src/graph/workflows/rag.py):

- the chunks: TextNodes are built from ``headrace.graph.ops.chunk_text``, not from a
  LlamaIndex splitter, so both systems index the same texts;
- the config keys, defaults and validation (headrace's own workflow schemas);
- the prompt texts: the LlamaIndex templates are headrace's ANSWER, REFINE and EXPAND
  (ANSWER and REFINE in the order ``context_first`` picks) with LlamaIndex's variable names, so each call sends exactly the text headrace
  renders, as one user message (headrace renders every prompt as one user turn in the
  chat template, no system message); temperature 0, and max_tokens per call as the
  workflow sets it (16 * n_queries for the expansion).

What differs (LlamaIndex's structure, kept on purpose; see also ``_tree_helper``):

- naive_rag ("tree" synthesis): TreeSummarize uses ONE template for every level, so the
  combine calls use ANSWER's wording ("Answer the question using the context. ...
  Context: <answers> Answer:") where headrace uses COMBINE ("Combine these answers to
  the question into one answer. ... Combined answer:"). The answers a combine call
  sees are labelled "Answer 1: ...", one per line, as in headrace's COMBINE body. The
  call structure is the same: one leaf per retrieved chunk, then fan-in 3 per level.
  LlamaIndex's async path sends the calls of one level concurrently (TreeSummarize's
  aget_response gathers them whatever ``use_async`` says), as headrace's graph does.
  With top_k = 1 LlamaIndex answers with ANSWER where headrace uses ONE_SHOT.
- advanced_rag: the expansion is QueryFusionRetriever's (its own line parsing: no
  stripping of "1." or "-" markers, and it decodes up to max_tokens where headrace
  stops after n_queries lines); candidates are fused by max score (mode "simple")
  and all of them go to one rerank request, as headrace reranks its whole pool.
  Refine skips an empty answer (the next chunk gets ANSWER again) and sends the
  previous answer unstripped; headrace always refines and strips every answer.
- retrieval: LlamaIndex's in-memory cosine search over the daemon's embeddings
  (OpenAIEmbedding replaces newlines by spaces, batches 10 texts per request and sends
  the batches concurrently); headrace searches LanceDB. When a run has fewer chunks
  than top_k / top_n, LlamaIndex synthesizes over the chunks it has, where headrace
  pads the missing contexts with empty strings.
- nothing is retried and nothing is downloaded: max_retries=0 (a failure surfaces
  instead of being re-sent silently), and every LlamaIndex component that counts tokens
  is given the harness's tokenizer (no tiktoken), no SentenceSplitter (no nltk).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any, Callable, Mapping

from headrace.bench.baselines import client_validate, require
from headrace.graph.ops import chunk_text
from headrace.graph.prompts import PLACEHOLDER
from headrace.graph.workflow import Workflow
from headrace.graph.workflows import common, rag

WHAT = "the LlamaIndex baseline"
WORKFLOWS: dict[str, Workflow] = {"naive_rag": rag.NAIVE, "advanced_rag": rag.ADVANCED}
SYNTHESIS = {"naive_rag": "tree", "advanced_rag": "refine"}  # the one each pipeline implements
CONTEXT_WINDOW = 8192  # SmolLM2's
TREE_FAN_IN = 3  # common.synthesize's default


def li_template(text: str, names: Mapping[str, str]) -> str:
    """A headrace prompt as a LlamaIndex (``{name}``) template that formats to the same text.

    ``names`` maps each headrace input to LlamaIndex's variable; the output placeholder is
    dropped and trailing spaces stripped, as ``PromptTemplate.render`` does.
    """
    out, pos = [], 0
    for m in PLACEHOLDER.finditer(text):
        static = text[pos : m.start()]
        if "{" in static or "}" in static:
            raise ValueError(f"literal braces in prompt text {static!r} would not survive LlamaIndex's formatting")
        out.append(static)
        if m.group(1) == "input":
            out.append("{" + names[m.group(2)] + "}")
        pos = m.end()
    if "{" in text[pos:] or "}" in text[pos:]:
        raise ValueError("literal braces in prompt text would not survive LlamaIndex's formatting")
    out.append(text[pos:])
    return "".join(out).rstrip(" ")


# The prompts, from the workflow modules so the texts cannot drift; by ``context_first``, as common.STEPS.
ANSWER_NAMES = {"question": "query_str", "context": "context_str"}
REFINE_NAMES = {"question": "query_str", "previous": "existing_answer", "context": "context_msg"}
ANSWER_TEMPLATE = li_template(common.ANSWER, ANSWER_NAMES)
REFINE_TEMPLATE = li_template(common.REFINE, REFINE_NAMES)
TEMPLATES = {False: (ANSWER_TEMPLATE, REFINE_TEMPLATE),
             True: (li_template(common.answer_context_first.prompt, ANSWER_NAMES),
                    li_template(common.refine_context_first.prompt, REFINE_NAMES))}
EXPAND_TEMPLATE = li_template(rag.EXPAND, {"n_queries": "num_queries", "question": "query"})


def validate(workflow: str, inputs: Any, config: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """headrace's own validation and defaults, one synthesis mode per workflow, the same split errors."""
    inputs, config = client_validate(WHAT, WORKFLOWS, workflow, inputs, config)
    if config["synthesis"] != SYNTHESIS[workflow]:
        raise ValueError(f"config.synthesis: {WHAT}'s {workflow} implements {SYNTHESIS[workflow]!r} only")
    if config.get("place_documents"):
        raise ValueError(f"config.place_documents: {WHAT} prefills every chunk; it places none")
    if "documents" in inputs:
        common.count_chunks(inputs, "documents", config)  # the same errors for a bad split
    return inputs, config


@functools.cache
def _lib() -> SimpleNamespace:
    """LlamaIndex, imported on first use, and the few classes the pipelines subclass from it."""
    require("llama_index.core", "llama-index-core", WHAT)
    require("llama_index.llms.openai_like", "llama-index-llms-openai-like", WHAT)
    require("llama_index.embeddings.openai_like", "llama-index-embeddings-openai-like", WHAT)
    import httpx
    from llama_index.core import PromptTemplate, StorageContext, VectorStoreIndex
    from llama_index.core.bridge.pydantic import PrivateAttr
    from llama_index.core.indices.prompt_helper import ChatPromptHelper, PromptHelper
    from llama_index.core.node_parser.text.utils import truncate_text
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.query_engine import RetrieverQueryEngine
    from llama_index.core.response_synthesizers import ResponseMode, get_response_synthesizer
    from llama_index.core.retrievers import QueryFusionRetriever
    from llama_index.core.retrievers.fusion_retriever import FUSION_MODES
    from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, TextNode, TransformComponent
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding
    from llama_index.llms.openai_like import OpenAILike

    class LeafPerChunkHelper(PromptHelper):
        """A PromptHelper for TreeSummarize that keeps headrace's "tree" structure; one per query.

        TreeSummarize repacks its texts before every level. The stock repack joins them and
        re-splits by tokens to fill the context window: all retrieved chunks would go into one
        call, and ``chunk_size_limit`` alone cannot help, as its token splitter cuts across
        chunk boundaries (and a combine level would pack as many answers as happen to fit).
        This repack keeps chunk boundaries: at the first call (the leaves) every retrieved
        chunk is its own text (cut to the context budget only if it overflows it); at each
        later call (the answers of the level below) it packs ``fan_in`` answers per text,
        labelled "Answer j:" one per line, as headrace's COMBINE lists them.
        """

        _fan_in: int = PrivateAttr(default=TREE_FAN_IN)
        _calls: int = PrivateAttr(default=0)

        def repack(self, prompt, text_chunks, padding=5, llm=None, tools=None):  # type: ignore[override]
            level, self._calls = self._calls, self._calls + 1
            texts = [str(t).strip() for t in text_chunks]
            if level == 0:
                budget = self._get_available_chunk_size(prompt, 1, padding=padding, llm=llm, tools=tools)
                splitter = None
                out = []
                for text in texts:
                    if self._token_counter.get_string_tokens(text) > budget:
                        splitter = splitter or self.get_text_splitter_given_prompt(prompt, 1, padding, llm, tools)
                        text = truncate_text(text, splitter)
                    out.append(text)
                return out or [""]
            groups = [texts[i : i + self._fan_in] for i in range(0, len(texts), self._fan_in)]
            return ["\n".join(f"Answer {j + 1}: {a}" for j, a in enumerate(g)) for g in groups] or [""]

    class DaemonRerank(BaseNodePostprocessor):
        """Rerank with the daemon's ``POST /v1/rerank``, all candidates in one request, keeping ``top_n``.

        This is how LlamaIndex's hosted-rerank postprocessors (Cohere, Jina) work.
        """

        model: str
        top_n: int = 3
        url: str
        api_key: str = ""
        _client: Any = PrivateAttr(default=None)

        def __init__(self, client: Any = None, **data: Any) -> None:
            super().__init__(**data)
            self._client = client

        @classmethod
        def class_name(cls) -> str:
            return "HeadraceDaemonRerank"

        def _request(self, nodes: list, query_bundle: Any) -> tuple[dict[str, Any], dict[str, str]]:
            if query_bundle is None:
                raise ValueError("reranking needs the query")
            body = {"model": self.model, "query": query_bundle.query_str,
                    "documents": [n.node.get_content(metadata_mode=MetadataMode.NONE) for n in nodes],
                    "top_n": self.top_n, "return_documents": False}
            return body, ({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})

        def _keep(self, nodes: list, response: Any) -> list:
            if response.status_code != 200:
                raise RuntimeError(f"POST {self.url}: {response.status_code} {response.text}")
            out = []
            for r in response.json()["results"]:
                node = nodes[r["index"]]
                out.append(NodeWithScore(node=node.node, score=r["relevance_score"]))
            return out

        def _postprocess_nodes(self, nodes, query_bundle=None):
            if not nodes:
                return []
            body, headers = self._request(nodes, query_bundle)
            return self._keep(nodes, httpx.post(self.url, json=body, headers=headers, timeout=None))

        async def _apostprocess_nodes(self, nodes, query_bundle=None):
            if not nodes:
                return []
            body, headers = self._request(nodes, query_bundle)
            if self._client is None:
                async with httpx.AsyncClient(timeout=None) as client:
                    return self._keep(nodes, await client.post(self.url, json=body, headers=headers))
            return self._keep(nodes, await self._client.post(self.url, json=body, headers=headers))

    class KeepNodes(TransformComponent):
        """The index's transformations: none, the nodes are headrace's chunks already.

        Given explicitly so that VectorStoreIndex does not build Settings' default
        SentenceSplitter (tiktoken, nltk, and global state).
        """

        def __call__(self, nodes, **kwargs):
            return nodes

    return SimpleNamespace(**locals())


class LlamaIndexRAG:
    """naive_rag and advanced_rag as LlamaIndex pipelines against the daemon at ``base_url``.

    ``base_url`` is the daemon's root URL (``http://127.0.0.1:8000``; one ending in ``/v1``
    is accepted too); ``llm``, ``embed`` and ``rerank`` are the daemon's model ids;
    ``tokenizer`` counts tokens for LlamaIndex's prompt packing (the harness passes the
    SmolLM2 tokenizer's ``encode``; default ``str.split``). Every request (LLM, embeddings,
    rerank) goes through one ``httpx.AsyncClient``: ``http_client`` if given (the caller
    closes it), else one made on first use with no connection cap. One instance serves
    any number of concurrent runs on one event loop; ``aclose()`` (or ``async with``)
    releases its connections.
    """

    def __init__(self, base_url: str, api_key: str, llm: str, embed: str, rerank: str,
                 tokenizer: Callable[[str], list] | None = None, *, context_window: int = CONTEXT_WINDOW,
                 timeout: float = 600.0, http_client: Any = None) -> None:
        self._li = _lib()  # MissingPeer here, not halfway through a benchmark
        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        self.api_base = root + "/v1"
        self.api_key = api_key
        self.llm, self.embed, self.rerank = llm, embed, rerank
        self.tokenizer: Callable[[str], list] = tokenizer or str.split
        self.context_window = context_window
        self.timeout = timeout
        self._http: Any = http_client  # else made on first use, in the loop that uses it
        self._own_http = http_client is None
        self._llms: dict[int, Any] = {}
        self._embed_model: Any = None
        self._collections: dict[str, Any] = {}  # name -> an index built once (``index_collection``)

    # shared clients -------------------------------------------------------------------

    def _client(self) -> Any:
        if self._http is None:
            import httpx

            # No client-side connection cap: requests queue in the daemon, as headrace's own do.
            self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=10.0),
                                           limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        return self._http

    def _llm(self, max_tokens: int) -> Any:
        """An OpenAILike per max_tokens (LlamaIndex's FusionRetriever cannot pass one per call)."""
        if max_tokens not in self._llms:
            self._llms[max_tokens] = self._li.OpenAILike(
                model=self.llm, api_base=self.api_base, api_key=self.api_key or "unused",
                is_chat_model=True, is_function_calling_model=False, context_window=self.context_window,
                max_tokens=max_tokens, temperature=0.0, max_retries=0, timeout=self.timeout,
                async_http_client=self._client(),
            )
        return self._llms[max_tokens]

    def _embedder(self) -> Any:
        if self._embed_model is None:
            self._embed_model = self._li.OpenAILikeEmbedding(
                model_name=self.embed, api_base=self.api_base, api_key=self.api_key or "unused",
                max_retries=0, timeout=self.timeout, async_http_client=self._client(),
            )
        return self._embed_model

    async def aclose(self) -> None:
        if self._http is not None and self._own_http:
            await self._http.aclose()
            self._http = None
        self._llms.clear()
        self._embed_model = None

    async def __aenter__(self) -> "LlamaIndexRAG":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    # pipelines ------------------------------------------------------------------------

    async def run(self, workflow: str, inputs: dict, config: dict) -> dict:
        """Run ``workflow`` ("naive_rag" or "advanced_rag") on ``inputs`` = {question, documents}, or
        {question, collection} over an index built once by ``index_collection``."""
        inputs, config = validate(workflow, inputs, config)
        if "collection" in inputs:
            index = self._collections.get(inputs["collection"])
            if index is None:
                raise ValueError(f"inputs.collection: {WHAT} has no index {inputs['collection']!r} "
                                 "(build it once with index_collection)")
        else:
            index = await self._index(inputs["documents"], config["chunk_size"], config["chunk_overlap"])
        build = self._naive if workflow == "naive_rag" else self._advanced
        response = await build(index, config).aquery(inputs["question"])
        return {"answer": (response.response or "").strip()}

    async def index_collection(self, name: str, documents: list[str], chunk_size: int, chunk_overlap: int) -> int:
        """Index ``documents`` once as ``name``, kept for every later query (what a LlamaIndex service does
        with a corpus: build the VectorStoreIndex at start, query it per request); returns the chunk count."""
        index = await self._index(documents, chunk_size, chunk_overlap)
        self._collections[name] = index
        return len(chunk_text(documents, chunk_size, chunk_overlap))

    async def _index(self, documents: list[str], chunk_size: int, chunk_overlap: int) -> Any:
        """An in-memory index over headrace's chunks, embedded through the async API."""
        li = self._li
        nodes = [li.TextNode(text=t) for t in chunk_text(documents, chunk_size, chunk_overlap)]
        index = li.VectorStoreIndex(nodes=[], embed_model=self._embedder(), transformations=[li.KeepNodes()],
                                    storage_context=li.StorageContext.from_defaults())
        await index.ainsert_nodes(nodes)
        return index

    def _helpers(self, llm: Any, tree: bool = False) -> dict[str, Any]:
        li = self._li
        cls = li.LeafPerChunkHelper if tree else li.PromptHelper
        return {
            "prompt_helper": cls.from_llm_metadata(llm.metadata, tokenizer=self.tokenizer),
            "chat_prompt_helper": li.ChatPromptHelper.from_llm_metadata(llm.metadata, tokenizer=self.tokenizer),
        }

    def _naive(self, index: Any, config: dict[str, Any]) -> Any:
        li = self._li
        llm = self._llm(config["max_tokens"])
        synth = li.get_response_synthesizer(
            llm=llm, response_mode=li.ResponseMode.TREE_SUMMARIZE, use_async=False,
            summary_template=li.PromptTemplate(TEMPLATES[config["context_first"]][0]),
            **self._helpers(llm, tree=True),
        )
        retriever = index.as_retriever(similarity_top_k=config["top_k"])
        return li.RetrieverQueryEngine(retriever=retriever, response_synthesizer=synth)

    def _advanced(self, index: Any, config: dict[str, Any]) -> Any:
        li = self._li
        llm = self._llm(config["max_tokens"])
        n, k = config["n_queries"], config["k_per_query"]
        retriever = li.QueryFusionRetriever(
            [index.as_retriever(similarity_top_k=k)],
            llm=self._llm(16 * n),  # the expansion's budget, as headrace's
            query_gen_prompt=EXPAND_TEMPLATE,
            mode=li.FUSION_MODES.SIMPLE,
            num_queries=n + 1,  # LlamaIndex counts the original question; it generates n
            similarity_top_k=k * (n + 1),  # every fused candidate goes to the reranker
            use_async=False,
        )
        rerank = li.DaemonRerank(client=self._client(), model=self.rerank, top_n=config["top_n"],
                                 url=f"{self.api_base}/rerank", api_key=self.api_key)
        answer, refine = TEMPLATES[config["context_first"]]
        synth = li.get_response_synthesizer(
            llm=llm, response_mode=li.ResponseMode.REFINE,
            text_qa_template=li.PromptTemplate(answer),
            refine_template=li.PromptTemplate(refine), **self._helpers(llm),
        )
        return li.RetrieverQueryEngine(retriever=retriever, response_synthesizer=synth, node_postprocessors=[rerank])


__all__ = ["LlamaIndexRAG", "ANSWER_TEMPLATE", "REFINE_TEMPLATE", "TEMPLATES", "EXPAND_TEMPLATE", "li_template", "validate"]
