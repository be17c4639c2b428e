"""The per-workflow Markov model of engine calls, and the preloader's accuracy counts, on scripted sequences."""

import pytest

from headrace.daemon.config import Config, ResidencyConfig
from headrace.daemon.metrics import Metrics
from headrace.daemon.pool import EnginePool
from headrace.daemon.preload import Preloader
from headrace.graph.markov import END, START, MarkovModel
from conftest import metric_value


def test_predictions_follow_the_learned_transition_frequencies():
    model = MarkovModel()
    assert model.predict("rag", START) == []  # nothing learned yet
    for _ in range(3):
        model.learn("rag", [START, "embed", "embed", "store", "llm-a", END])  # the repeat is one visit
    model.learn("rag", [START, "embed", "store", "llm-b", END])
    assert [(p.state, p.probability) for p in model.predict("rag", START)] == [("embed", 1.0)]
    assert [(p.state, p.probability) for p in model.predict("rag", "embed")] == [("store", 1.0)]
    assert [(p.state, p.probability) for p in model.predict("rag", "store")] == [("llm-a", 0.75), ("llm-b", 0.25)]
    assert [(p.state, p.probability) for p in model.predict("rag", "llm-b")] == [(END, 1.0)]
    assert model.predict("rag", "llm-c") == []
    assert model.predict("summary", START) == []  # each workflow has its own model


def test_equally_likely_states_rank_by_name():
    model = MarkovModel()
    model.learn("w", [START, "b"])
    model.learn("w", [START, "a"])
    assert [p.state for p in model.predict("w", START)] == ["a", "b"]


def test_engines_ahead_are_those_reached_within_the_steps_soonest_first():
    model = MarkovModel()
    # naive_rag with its own documents: index (embed, store), then embed the question, search, generate.
    for _ in range(3):
        model.learn("rag", [START, "embed", "store", "embed", "store", "llm-a", END])
    model.learn("rag", [START, "embed", "store", "embed", "store", "llm-b", END])
    # First-order: from the store the chain goes back to the embedder or on to an LLM, half each.
    # llm-a is reached within 3 steps from START with 1/2 * 3/4, within 5 with (1/2 + 1/4) * 3/4.
    ahead = model.ahead("rag", START, min_probability=0.3, steps=5)
    assert [p.state for p in ahead] == ["embed", "store", "llm-a"]
    assert [p.probability for p in ahead] == pytest.approx([1.0, 1.0, 0.75 * 0.75])
    assert model.ahead("rag", START, min_probability=0.3, steps=2) == ahead[:2]  # llm-a is 3 calls away
    # Within 7 steps (3, 5 or 7 calls away): (1/2 + 1/4 + 1/8) * 3/4; more steps never reach 3/4.
    assert model.ahead("rag", START, min_probability=0.6, steps=8)[2].probability == pytest.approx(0.875 * 0.75)
    assert model.ahead("rag", START, min_probability=0.75, steps=8) == ahead[:2]
    # One step ahead: the next call's engines, as ``predict`` gives them (less END and the unlikely ones).
    assert [(p.state, p.probability) for p in model.ahead("rag", "store", 0.3, steps=1)] == [
        ("embed", 0.5), ("llm-a", 0.375)]
    assert [(p.state, p.probability) for p in model.ahead("rag", "store", 0.1, steps=1)] == [
        ("embed", 0.5), ("llm-a", 0.375), ("llm-b", 0.125)]
    assert model.ahead("rag", "llm-a", 0.1, steps=8) == []  # it ends there
    assert model.ahead("rag", "llm-c", 0.1, steps=8) == []  # never seen
    assert model.ahead("summary", START, 0.1, steps=8) == []


def test_the_preloader_learns_from_ended_runs_and_counts_its_hits():
    metrics = Metrics()
    preloader = Preloader(EnginePool(Config(), registry=_no_plugins(), metrics=metrics), metrics, ResidencyConfig(),
                          workflows=["rag"])
    script = ["embed", "store", "store", "llm"]

    def run(run_id: str, calls: list[str], status: str = "succeeded") -> None:
        preloader.run_started(run_id, "rag")
        for engine in calls:
            preloader.engine_called(run_id, engine)
        preloader.run_ended(run_id, status)

    run("r1", script)  # nothing learned before it: no prediction to check
    text = metrics.render().decode()
    assert metric_value(text, "headrace_markov_predictions_total", workflow="rag") == 0
    run("r2", script)  # START->embed, embed->store, store->llm, llm->END: all four as learned
    text = metrics.render().decode()
    assert metric_value(text, "headrace_markov_predictions_total", workflow="rag") == 4
    assert metric_value(text, "headrace_markov_predictions_correct_total", workflow="rag") == 4
    run("r3", ["embed", "llm"])  # embed->llm is a miss (store was learned), llm->END a hit
    text = metrics.render().decode()
    assert metric_value(text, "headrace_markov_predictions_total", workflow="rag") == 7
    assert metric_value(text, "headrace_markov_predictions_correct_total", workflow="rag") == 6
    run("r4", ["embed", "store"], status="cancelled")  # not learned: a cancelled run stops anywhere
    assert [(p.state, p.probability) for p in preloader.model.predict("rag", "embed")] == [
        ("store", pytest.approx(2 / 3)), ("llm", pytest.approx(1 / 3))]
    # A plain request runs as a run too, but is no workflow: neither learned nor counted.
    preloader.run_started("chat", "request")
    preloader.engine_called("chat", "llm")
    preloader.run_ended("chat", "succeeded")
    assert preloader.model.predict("request", START) == []
    assert 'workflow="request"' not in metrics.render().decode()


class RecordingPool(EnginePool):
    """A real pool (no engines) that records what the preloader asks it to load."""

    def __init__(self) -> None:
        super().__init__(Config(), registry=_no_plugins(), metrics=Metrics())
        self.asked: list[tuple[list[str], str | None]] = []

    def preload(self, names, after=None):
        self.asked.append((list(names), after))
        return []


@pytest.mark.parametrize("steps, at_start", [(8, ["embed", "store", "llm"]), (1, ["embed"])])
def test_a_run_preloads_the_engines_it_is_predicted_to_reach_within_the_steps(steps, at_start):
    pool = RecordingPool()
    preloader = Preloader(pool, pool.metrics, ResidencyConfig(budget_bytes=1, preload_steps=steps), workflows=["rag"])
    preloader.run_started("r1", "rag")
    for engine in ["embed", "store", "embed", "store", "llm"]:  # index, then embed the question, search, answer
        preloader.engine_called("r1", engine)
    preloader.run_ended("r1", "succeeded")
    pool.asked.clear()
    preloader.run_started("r2", "rag")
    # At the start, the LLM is three calls away: predicted there only when looking that far ahead.
    assert pool.asked == [(at_start, None)]
    preloader.engine_called("r2", "embed")
    assert pool.asked[-1] == (["store", "llm"] if steps > 1 else ["store"], "embed")


def _no_plugins():
    from headrace.plugins.manager import collect

    return collect()
