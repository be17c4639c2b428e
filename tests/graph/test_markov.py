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


def _no_plugins():
    from headrace.plugins.manager import collect

    return collect()
