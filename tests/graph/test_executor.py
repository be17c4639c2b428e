"""The executor on graphs of plain Python functions (no models), the run store, and aggregation."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest
import torch

from headrace.batching.resolved import ResolvedEngine
from headrace.graph.executor import Executor, Run
from headrace.graph.events import RunEvents
from headrace.graph.graph import Graph, Node, Op
from headrace.graph.aggregates import aggregate
from headrace.graph.ops import NodeError
from headrace.graph.passes import DecodePipelining, PassEnv
from headrace.graph.store import Store

pytestmark = pytest.mark.anyio


def no_engines(name):
    raise LookupError(name)


def fn(node_id, inputs, outputs, f, **params) -> Node:
    return Node(node_id, Op.FUNCTION, inputs=tuple(inputs), outputs=tuple(outputs), params={"fn": f, **params})


def slow(seconds, f):
    async def run(*args):
        await anyio.sleep(seconds)
        return f(*args)
    return run


def graph(*nodes: Node, order=(), branches=None) -> Graph:
    g = Graph("t")
    for n in nodes:
        g.add(n)
    g.rewire()
    for src, dst in order:
        g.connect(src, dst)
    g.branches = branches or {}
    g.compute_depths()
    return g


def record(run: Run, node_id: str, key: tuple = ()):
    [r] = [r for r in run.records if r.node == node_id and r.key == key]
    return r


class RecordedEvents(RunEvents):
    """A run's event log that also keeps every event published, unstamped, in a list."""

    def __init__(self, into: list) -> None:
        super().__init__()
        self.into = into

    def publish(self, event) -> None:
        self.into.append(event)
        super().publish(event)


def make_run(g: Graph, inputs, outputs, events=None) -> Run:
    run = Run(workflow="t", graph=g, inputs=dict(inputs), outputs=tuple(outputs))
    if events is not None:
        run.events = RecordedEvents(events)
    return run


# dispatch ----------------------------------------------------------------------------


async def test_dependencies_order_dispatch_and_independent_nodes_overlap():
    g = graph(
        fn("a", ["x"], ["ya"], slow(0.1, lambda x: x + 1)),
        fn("b", ["x"], ["yb"], slow(0.1, lambda x: x * 10)),
        fn("c", ["ya", "yb"], ["z"], slow(0.01, lambda a, b: a + b)),
        fn("d", [], ["w"], slow(0.01, lambda: "after c")),
        order=[("c", "d")],  # an order-only edge
    )
    events = []
    run = make_run(g, {"x": 2}, ["z", "w"], events)
    await Executor(no_engines).execute(run)
    assert run.status == "succeeded", run.error
    assert run.result == {"z": 3 + 20, "w": "after c"}
    a, b, c, d = (record(run, n) for n in "abcd")
    assert all(r.state == "done" for r in (a, b, c, d))
    # a and b are independent: both ran at once.
    assert a.started < b.finished and b.started < a.finished
    # c waited for both of its producers; d for c (order only).
    assert c.started >= max(a.finished, b.finished)
    assert d.started >= c.finished
    assert [e["event"] for e in events][0] == "run.started"
    assert events[-1]["event"] == "run.finished" and events[-1]["result"] == run.result
    started = [e["node"] for e in events if e["event"] == "node.started"]
    finished = [e["node"] for e in events if e["event"] == "node.finished"]
    assert sorted(started) == sorted(finished) == ["a", "b", "c", "d"]
    assert started.index("c") > max(finished.index("a"), finished.index("b"))


async def test_function_with_several_outputs():
    g = graph(fn("split", ["s"], ["head", "tail"], lambda s: (s[0], s[1:])))
    run = make_run(g, {"s": "abc"}, ["head", "tail"])
    await Executor(no_engines).execute(run)
    assert run.result == {"head": "a", "tail": "bc"}


# conditions --------------------------------------------------------------------------


@pytest.mark.parametrize("x,taken,skipped", [(5, "big", "small"), (-5, "small", "big")])
async def test_condition_runs_only_the_taken_branch(x, taken, skipped):
    calls = []

    def tracked(name):
        def f(v):
            calls.append(name)
            return f"{name}:{v}"
        return f

    cond = Node("cond", Op.CONDITION, inputs=("x",), outputs=("label",), params={"predicate": lambda v: v > 0})
    g = graph(
        cond,
        fn("big", ["x"], ["big_out"], tracked("big"), default="no big"),
        fn("big2", ["big_out"], ["big_out2"], tracked("big2"), default="no big2"),
        fn("small", ["x"], ["small_out"], tracked("small"), default="no small"),
        fn("join", ["big_out2", "small_out", "label"], ["answer"], lambda b, s, l: (b, s, l)),
        order=[("cond", "big"), ("cond", "small")],
        branches={"cond": {"true": ["big", "big2"], "false": ["small"]}},
    )
    run = make_run(g, {"x": x}, ["answer"])
    await Executor(no_engines).execute(run)
    assert run.status == "succeeded", run.error
    if taken == "big":
        assert calls == ["big", "big2"]
        assert run.result["answer"] == ("big2:big:5", "no small", "true")
        assert record(run, "big2").state == "done"
    else:
        assert calls == ["small"]
        assert run.result["answer"] == ("no big2", "small:-5", "false")
        assert record(run, "big2").state == "skipped"
    assert record(run, skipped).state == "skipped"
    assert record(run, taken).state == "done"


async def test_condition_with_string_labels():
    cond = Node("route", Op.CONDITION, inputs=("q",), outputs=("label",),
                params={"predicate": lambda q: "search" if "?" in q else "direct"})
    g = graph(
        cond,
        fn("search", ["q"], ["s"], lambda q: "searched", default=None),
        fn("direct", ["q"], ["d"], lambda q: "answered", default=None),
        order=[("route", "search"), ("route", "direct")],
        branches={"route": {"search": ["search"], "direct": ["direct"]}},
    )
    run = make_run(g, {"q": "why?"}, ["s", "d", "label"])
    await Executor(no_engines).execute(run)
    assert run.result == {"s": "searched", "d": None, "label": "search"}


# failures and cancellation -----------------------------------------------------------


def boom(_):
    raise ValueError("boom")


async def test_a_failing_node_fails_its_run_only():
    bad = graph(
        fn("ok", ["x"], ["y"], slow(3600, lambda x: x)),  # still running when the failure happens
        fn("explode", ["x"], ["z"], slow(0.02, boom)),
        fn("after", ["z"], ["w"], lambda z: z),
    )
    good = graph(fn("a", ["x"], ["y"], slow(0.1, lambda x: x + 1)), fn("b", ["y"], ["z"], lambda y: y * 2))
    ev_bad, ev_good = [], []
    run_bad, run_good = make_run(bad, {"x": 1}, ["w"], ev_bad), make_run(good, {"x": 1}, ["z"], ev_good)
    executor = Executor(no_engines)
    # A hang guard, not a speed target: the slow sibling is cancelled, not awaited.
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(executor.execute, run_bad)
            tg.start_soon(executor.execute, run_good)
    assert run_bad.status == "failed"
    assert "'explode'" in run_bad.error and "ValueError" in run_bad.error and "boom" in run_bad.error
    assert run_bad.result is None
    assert record(run_bad, "explode").state == "failed"
    assert record(run_bad, "ok").state == "cancelled"
    assert not [r for r in run_bad.records if r.node == "after"]
    assert ev_bad[-1]["event"] == "run.failed" and ev_bad[-1]["status"] == "failed"
    assert ev_bad[-1]["error"] == run_bad.error
    assert run_good.status == "succeeded" and run_good.result == {"z": 4}
    assert ev_good[-1]["event"] == "run.finished"
    assert run_bad.done.is_set() and run_good.done.is_set()


async def test_a_failing_condition_predicate_is_named():
    cond = Node("cond", Op.CONDITION, inputs=("x",), outputs=("label",), params={"predicate": boom})
    run = make_run(graph(cond), {"x": 1}, ["label"])
    await Executor(no_engines).execute(run)
    assert run.status == "failed" and "'cond'" in run.error and "boom" in run.error


async def test_a_node_without_an_engine_fails_cleanly():
    g = graph(Node("e", Op.EMBED, inputs=("x",), outputs=("v",)))
    run = make_run(g, {"x": "text"}, ["v"])
    await Executor(no_engines).execute(run)
    assert run.status == "failed" and "'e'" in run.error and "no engine" in run.error


async def test_cancelling_a_run_mid_way():
    started = anyio.Event()
    finished = []

    async def forever(x):
        started.set()
        await anyio.sleep(30)
        finished.append(x)

    g = graph(fn("quick", ["x"], ["q"], lambda x: x), fn("a", ["q"], ["y"], forever), fn("b", ["q"], ["z"], forever),
              fn("c", ["y", "z"], ["w"], lambda y, z: 0))
    events = []
    run = make_run(g, {"x": 1}, ["w"], events)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(Executor(no_engines).execute, run)
            await started.wait()
            run.cancel_scope.cancel()
    assert run.done.is_set()
    assert run.status == "cancelled" and run.error == "cancelled"
    assert finished == []
    assert not [r for r in run.records if r.state == "running"]
    assert record(run, "quick").state == "done"
    assert {record(run, n).state for n in "ab"} == {"cancelled"}
    assert not [r for r in run.records if r.node == "c"]
    assert events[0]["event"] == "run.started"
    assert events[-1] == {"event": "run.failed", "run": run.id, "status": "cancelled", "error": "cancelled"}


# regions (one instance per item of a list) -------------------------------------------


class StubLLM:
    """A scheduler stand-in that streams fixed text deltas; nothing is computed."""

    def __init__(self, deltas, delay=0.02):
        self.deltas, self.delay = deltas, delay

    async def prefill(self, context, tokens, parent=None, meta=None):
        pass

    async def free(self, context):
        pass

    def busy_with_other_runs(self, run):
        return False

    def generate(self, tokens, params, meta=None):
        raise NotImplementedError

    async def next_token_logits(self, prompts, token_ids, metas=()):
        raise NotImplementedError

    async def decode(self, context, params, meta=None):
        for text in self.deltas:
            await anyio.sleep(self.delay)
            yield SimpleNamespace(text=text)


class StubEmbed:
    """Embeds a text as [len(text)]; records the requests it saw."""

    def __init__(self):
        self.requests = []

    async def submit(self, request, size, meta=None):
        self.requests.append((list(request.texts), meta))
        await anyio.sleep(0.001)
        return torch.tensor([[float(len(t))] for t in request.texts])


async def test_streamed_region_runs_per_piece_as_pieces_arrive():
    deltas = ["1. al", "pha\n2. be", "ta\n", "3. gam", "ma\n", "alpha\n"]
    g = graph(
        Node("expand", Op.PARTIAL_DECODE, engine="lm", inputs=("ctx",), outputs=("queries", "expand.pieces"),
             splittable="lines"),
        Node("up", Op.FUNCTION, inputs=("queries",), outputs=("upper.piece",), region="expand",
             params={"fn": slow(0.001, str.upper)}),
        Node("expand.upper.agg", Op.AGGREGATE, inputs=("upper.piece",), outputs=("upper",),
             params={"op": "concat", "dedupe": True, "source": "expand", "reads": ("expand.pieces",)}),
        fn("join", ["upper", "queries"], ["answer"], lambda u, q: (u, q)),
    )
    assert g.in_edges("up")[0].stream
    events = []
    run = make_run(g, {"ctx": "c0"}, ["answer"], events)
    engines = {"lm": ResolvedEngine(None, StubLLM(deltas))}
    await Executor(engines.__getitem__).execute(run)
    assert run.status == "succeeded", run.error
    # Pieces in order; the aggregate dedupes the repeated one; the decode's own output is every piece.
    assert run.result["answer"] == (["ALPHA", "BETA", "GAMMA"], ["alpha", "beta", "gamma", "alpha"])
    ups = sorted((r for r in run.records if r.node == "up"), key=lambda r: r.key)
    assert [r.key for r in ups] == [(0,), (1,), (2,), (3,)]
    decode = record(run, "expand")
    # The first piece's instance ran while the decode was still streaming.
    assert ups[0].finished < decode.finished
    assert record(run, "expand.upper.agg").started >= decode.finished
    pieces = [e["piece"] for e in events if e["event"] == "node.partial"]
    assert pieces == ["alpha", "beta", "gamma", "alpha"]


async def test_pipelined_decode_embeds_each_piece_and_aggregates_vectors():
    g = Graph("p")
    g.add(Node("expand", Op.DECODE, engine="lm", inputs=("ctx",), outputs=("queries",), splittable="json"))
    g.add(Node("embed", Op.EMBED, engine="emb", inputs=("queries",), outputs=("vectors",), batchable=True))
    g.add(fn("count", ["vectors"], ["n"], lambda v: tuple(v.shape)))
    g.rewire()
    DecodePipelining().apply(g, PassEnv())
    g.compute_depths()
    assert g.nodes["embed"].region == "expand"
    embed = StubEmbed()
    engines = {"lm": ResolvedEngine(None, StubLLM(['["ab", "c', 'de", "f"', "]"])), "emb": ResolvedEngine(None, embed)}
    run = make_run(g, {"ctx": "c0"}, ["n", "vectors"])
    await Executor(engines.__getitem__).execute(run)
    assert run.status == "succeeded", run.error
    assert run.result["n"] == (3, 1)
    assert run.result["vectors"].flatten().tolist() == [2.0, 3.0, 1.0]
    assert [texts for texts, _ in embed.requests] == [["ab"], ["cde"], ["f"]]
    # The scheduler sees the primitive: its run, node and piece key.
    assert [meta.key for _, meta in embed.requests] == [(0,), (1,), (2,)]
    assert {meta.node for _, meta in embed.requests} == {"embed"}
    assert {meta.run for _, meta in embed.requests} == {run.id}


async def test_region_failure_names_the_inner_node():
    g = graph(
        Node("expand", Op.PARTIAL_DECODE, engine="lm", inputs=("ctx",), outputs=("queries", "expand.pieces"),
             splittable="lines"),
        Node("check", Op.FUNCTION, inputs=("queries",), outputs=("ok.piece",), region="expand",
             params={"fn": lambda q: 1 / 0 if q == "bad" else q}),
        Node("expand.ok.agg", Op.AGGREGATE, inputs=("ok.piece",), outputs=("ok",),
             params={"op": "concat", "source": "expand", "reads": ("expand.pieces",)}),
    )
    run = make_run(g, {"ctx": "c"}, ["ok"])
    await Executor({"lm": ResolvedEngine(None, StubLLM(["fine\n", "bad\n", "more\n"]))}.__getitem__).execute(run)
    assert run.status == "failed"
    assert "'check'" in run.error and "ZeroDivisionError" in run.error
    assert not [r for r in run.records if r.state == "running"]


async def test_function_source_maps_a_region_over_its_list():
    from headrace.graph.regions import map_over

    g = graph(fn("src", ["text"], ["items"], str.split), fn("up", ["items"], ["upper"], str.upper),
              fn("join", ["upper"], ["out"], "-".join))
    map_over(g, g.nodes["src"], {"up"})
    run = make_run(g, {"text": "a b c"}, ["out"])
    await Executor(no_engines).execute(run)
    assert run.status == "succeeded", run.error
    assert run.result == {"out": "A-B-C"}


async def test_error_inside_a_region_source_names_the_cause():
    g = graph(
        Node("expand", Op.PARTIAL_DECODE, engine="lm", inputs=("ctx",), outputs=("queries", "expand.pieces"),
             splittable="lines"),
        Node("up", Op.FUNCTION, inputs=("queries",), outputs=("u.piece",), region="expand",
             params={"fn": str.upper}),
    )

    class Broken(StubLLM):
        async def decode(self, context, params, meta=None):
            yield SimpleNamespace(text="one\n")
            raise RuntimeError("engine fell over")

    run = make_run(g, {"ctx": "c"}, ["u"])
    await Executor({"lm": ResolvedEngine(None, Broken([]))}.__getitem__).execute(run)
    assert run.status == "failed"
    assert "'expand'" in run.error and "engine fell over" in run.error


# the store ---------------------------------------------------------------------------


async def test_store_get_waits_for_a_declared_variable():
    store = Store({"x": 1}, declares={"y"})
    assert await store.get("x") == 1
    assert store.has("x") and not store.has("y")
    got = []

    async def reader():
        got.append(await store.get("y"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.sleep(0.01)
        assert got == []
        store.set("y", 2)
    assert got == [2] and store.peek("y") == 2


async def test_store_unknown_variable_raises():
    store = Store({"x": 1}, declares={"y"})
    with pytest.raises(KeyError, match="nope"):
        await store.get("nope")
    assert store.peek("nope", "dflt") == "dflt"


async def test_region_scope_sees_its_piece_and_waits_for_outer_values():
    outer = Store({"question": "q"}, declares={"collection", "queries"})
    outer.set("queries", ["a", "b"])  # the whole list, outside
    piece_a = outer.child({"queries": "a"}, declares={"vec.piece"})
    piece_b = outer.child({"queries": "b"}, declares={"vec.piece"})
    # Each scope sees its own piece under the source's name, and the outer values.
    assert await piece_a.get("queries") == "a" and await piece_b.get("queries") == "b"
    assert await outer.get("queries") == ["a", "b"]
    assert await piece_a.get("question") == "q"
    got = {}

    async def uses_collection(name, scope):
        got[name] = (await scope.get("collection"), await scope.get("vec.piece"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(uses_collection, "a", piece_a)
        tg.start_soon(uses_collection, "b", piece_b)
        await anyio.sleep(0.01)
        assert got == {}
        outer.set("collection", "run_1")  # set outside, later
        piece_a.set("vec.piece", 1)
        piece_b.set("vec.piece", 2)
    assert got == {"a": ("run_1", 1), "b": ("run_1", 2)}
    # A piece's values stay in its scope.
    assert not outer.has("vec.piece") and outer.peek("vec.piece") is None
    assert piece_a.peek("collection") == "run_1" and piece_a.has("collection")


async def test_nested_region_scopes():
    outer = Store({}, declares={"c"})
    mid = outer.child({"claim": "x"}, declares={"q"})
    inner = mid.child({"query": "y"}, declares={"hit.piece"})
    got = []

    async def read():
        got.append((await inner.get("claim"), await inner.get("q"), await inner.get("c")))

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.sleep(0.01)
        mid.set("q", "Q")
        outer.set("c", "C")
    assert got == [("x", "Q", "C")]


# aggregation -------------------------------------------------------------------------


def test_aggregate_concat_flattens_and_dedupes_strings():
    parts = [["a", "b"], "c", ["b", "d"], []]
    assert aggregate("concat", parts, {}) == ["a", "b", "c", "b", "d"]
    assert aggregate("concat", parts, {"dedupe": True}) == ["a", "b", "c", "d"]
    assert aggregate("concat", [], {"dedupe": True}) == []
    # Only all-string lists are deduped.
    assert aggregate("concat", [[1, 1], [2]], {"dedupe": True}) == [1, 1, 2]


def test_aggregate_concat_tensors_skips_empty_parts():
    out = aggregate("concat", [torch.ones(2, 3), torch.empty(0, 0), torch.zeros(1, 3)], {})
    assert out.shape == (3, 3) and out[:2].eq(1).all() and out[2].eq(0).all()


def test_aggregate_other_ops():
    assert aggregate("last", ["c0", "c1", "c2"], {}) == "c2"
    assert aggregate("sum", [1, 2, 3.5], {}) == 6.5
    assert aggregate("count", ["x", "y"], {}) == 2
    assert aggregate("count", [], {}) == 0
    scored = [[(0.1, "a"), (0.9, "b")], (0.5, "c"), [(0.7, "d")]]
    assert aggregate("topk", scored, {"k": 2}) == [(0.9, "b"), (0.7, "d")]
    assert aggregate("topk", scored, {}) == [(0.9, "b"), (0.7, "d"), (0.5, "c")]
    assert aggregate("filter", [1, 5, 2, 8], {"keep": lambda x: x > 2}) == [5, 8]


def test_aggregate_unknown_op():
    with pytest.raises(NodeError, match="median"):
        aggregate("median", [1], {})


async def test_aggregate_node_over_stages_runs_in_the_executor():
    g = graph(
        fn("s0", ["x"], ["p#0"], lambda x: [x, "a"]),
        fn("s1", ["x"], ["p#1"], lambda x: ["a", "b"]),
        Node("agg", Op.AGGREGATE, inputs=("p#0", "p#1"), outputs=("p",), params={"op": "concat", "dedupe": True}),
        Node("n", Op.AGGREGATE, inputs=("p#0", "p#1"), outputs=("count",), params={"op": "count"}),
    )
    run = make_run(g, {"x": "z"}, ["p", "count"])
    await Executor(no_engines).execute(run)
    assert run.result == {"p": ["z", "a", "b"], "count": 2}


# per-run vector-store tables ----------------------------------------------------------------


@pytest.mark.parametrize("ending", ["succeeded", "failed", "cancelled"])
async def test_a_runs_own_collection_is_dropped_when_it_ends(tmp_path, ending):
    """An ingest with no explicit collection makes run_<id>.lance; the run's end drops it, however it ends."""
    from headrace.batching.policies import FifoPolicy
    from headrace.batching.requests import runner_for
    from headrace.batching.scheduler import BatchScheduler
    from headrace.plugins.engines.retrieval import lancedb_store
    from headrace.plugins.protocols import EngineEnv, EngineSpec

    from conftest import running

    env = EngineEnv(data_dir=tmp_path, cache_dir=tmp_path, lookup=lambda name: None)
    store = lancedb_store.factory(EngineSpec(name="vs", plugin="lancedb"), env)

    sched = BatchScheduler("vs", runner_for(store), FifoPolicy(), max_batch_size=8, max_wait_ms=0)
    ingested = anyio.Event()

    async def after_ingest(collection):
        ingested.set()
        if ending == "failed":
            raise ValueError("a later node fails")
        if ending == "cancelled":
            await anyio.sleep_forever()
        return collection

    g = graph(
        fn("vectors", ["texts"], ["vecs"], lambda texts: torch.eye(len(texts), 4)),
        Node("ingest", Op.INGEST, engine="vs", inputs=("vecs", "texts"), outputs=("collection",)),
        fn("after", ["collection"], ["out"], after_ingest),
    )
    run = make_run(g, {"texts": ["one", "two", "three"]}, ["out"])
    tables = lambda: sorted(p.name for p in (tmp_path / "lancedb").glob("run_*"))  # noqa: E731
    async with running(store), anyio.create_task_group() as tg:
        await tg.start(sched.run)
        tg.start_soon(Executor({"vs": ResolvedEngine(store, sched)}.__getitem__).execute, run)
        with anyio.fail_after(60):
            await ingested.wait()
        assert tables() == [f"run_{run.id}.lance"]  # it existed while the run lived
        if ending == "cancelled":
            run.cancel_scope.cancel()
        with anyio.fail_after(60):
            await run.done.wait()
        tg.cancel_scope.cancel()
    assert run.status == ending, run.error
    assert tables() == []


def test_dot_labels_break_lines_as_graphviz_reads_them():
    g = Graph('say "hi"')
    g.add(Node("prefill", Op.PREFILL, engine="smollm2", outputs=("ctx",)))
    g.add(Node("decode", Op.DECODE, engine="smollm2", inputs=("ctx",), outputs=("text",)))
    g.rewire()
    dot = g.to_dot()
    # One backslash: DOT's line break. JSON quoting made it "\\n", which Graphviz prints as text.
    assert '"prefill" [label="prefill\\nprefill @smollm2", shape=box];' in dot
    assert "\\\\n" not in dot
    assert dot.startswith('digraph "say \\"hi\\"" {')
    assert '"prefill" -> "decode" [label="ctx", style=solid];' in dot


# growing runs (a session's calls) ----------------------------------------------------


async def test_a_growing_run_runs_each_added_set_as_it_arrives_and_isolates_failures():
    from headrace.graph.executor import Growth
    from headrace.graph.store import Failed

    g = Graph("session")
    send, receive = anyio.create_memory_object_stream[frozenset[str]](8)
    store = Store(declares={"x", "y", "z", "bad", "after_bad"})
    run = Run(workflow="session", graph=g, inputs={}, outputs=(), growth=Growth(receive, store))

    def add(*nodes: Node) -> frozenset[str]:
        for node in nodes:
            g.add(node)
        g.rewire()
        return frozenset(n.id for n in nodes)

    executor = Executor(no_engines)
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(executor.execute, run)
            # Added before its input's producer: it waits on the shared store, not on its own set.
            await send.send(add(fn("double", ["y"], ["z"], lambda y: y * 2)))
            await send.send(add(fn("inc", ["x"], ["y"], lambda x: x + 1)))
            await send.send(add(fn("explode", ["x"], ["bad"], boom)))
            await send.send(add(fn("reader", ["bad"], ["after_bad"], lambda b: b)))
            store.set("x", 20)
            assert await store.get("z") == 42
            failed = await store.get("after_bad")
            assert isinstance(failed, Failed) and "'bad' failed" in failed.error and "boom" in failed.error
            assert isinstance(store.peek("bad"), Failed)
            assert run.status == "running"  # one set's failure is not the run's
            await send.send(add(fn("late", ["z"], ["w"], lambda z: z + 1)))
            await send.aclose()  # nothing more can come: the run ends once the sets in flight do
    assert run.status == "succeeded"
    assert {r.node: r.state for r in run.records} == {"double": "done", "inc": "done", "explode": "failed",
                                                       "reader": "failed", "late": "done"}
