import heapq
import json
import random

import pytest

from headrace.bench.queueing import mean_responses, squared_cv
from conftest import ROOT, script_in_process


def simulate_srpt(sizes: dict[float, float], load: float, jobs: int, seed: int) -> float:
    """Mean response time of an M/G/1 SRPT queue, simulated job by job (ties first come first served)."""
    rng = random.Random(seed)
    values, weights = zip(*sizes.items())
    rate = load / sum(s * q for s, q in sizes.items())
    now, arrivals = 0.0, []
    for i in range(jobs):
        now += rng.expovariate(rate)
        arrivals.append((now, rng.choices(values, weights)[0]))
    waiting: list[tuple[float, int, float]] = []  # (remaining, arrival order, arrival time)
    clock, total, i = 0.0, 0.0, 0
    while i < jobs or waiting:
        if not waiting:
            clock = max(clock, arrivals[i][0])
        next_arrival = arrivals[i][0] if i < jobs else float("inf")
        if waiting and clock + waiting[0][0] <= next_arrival:
            remaining, _, arrived = heapq.heappop(waiting)
            clock += remaining
            total += clock - arrived
            continue
        if waiting:  # serve the shortest until the next arrival
            remaining, order, arrived = heapq.heappop(waiting)
            heapq.heappush(waiting, (remaining - (next_arrival - clock), order, arrived))
        clock = next_arrival
        heapq.heappush(waiting, (arrivals[i][1], i, arrivals[i][0]))
        i += 1
    return total / jobs


def test_one_size_gives_the_closed_forms():
    r = mean_responses({2.0: 1.0}, 0.6)
    rate = 0.6 / 2.0
    assert r.ps == pytest.approx(2.0 / 0.4)
    assert r.fcfs == pytest.approx(2.0 + rate * 4.0 / (2 * 0.4))  # M/D/1
    assert r.srpt == pytest.approx(r.fcfs)  # no job is ever shorter than the one in service
    assert squared_cv({2.0: 1.0}) == pytest.approx(0.0)


def test_two_sizes_match_a_hand_calculation_and_a_simulation():
    sizes = {1.0: 0.5, 3.0: 0.5}
    r = mean_responses(sizes, 0.5)
    # size 1: waits 0.125 / (1 * 0.875); size 3: waits 0.625 / (0.875 * 0.5), served 1 + 2 / 0.875
    assert r.srpt == pytest.approx(0.5 * (1 + 0.125 / 0.875) + 0.5 * (0.625 / 0.4375 + 1 + 2 / 0.875))
    assert r.srpt < r.fcfs < r.ps  # squared CV 0.25: FCFS beats PS, SRPT beats both
    assert simulate_srpt(sizes, 0.5, 200_000, seed=1) == pytest.approx(r.srpt, rel=0.03)


def test_a_heavy_tail_gives_srpt_its_large_wins():
    sizes = {1.0: 0.9, 50.0: 0.1}
    r = mean_responses(sizes, 0.8)
    assert squared_cv(sizes) > 1
    assert r.fcfs > r.ps > 1.5 * r.srpt
    assert simulate_srpt(sizes, 0.8, 1_000_000, seed=1) == pytest.approx(r.srpt, rel=0.05)


@pytest.mark.parametrize("sizes, load", [({1.0: 1.0}, 1.0), ({1.0: 1.0}, 0.0), ({-1.0: 1.0}, 0.5), ({1.0: 0.0}, 0.5)])
def test_bad_arguments_are_refused(sizes, load):
    with pytest.raises(ValueError):
        mean_responses(sizes, load)


def test_the_agents_bound_script_prints_and_writes_each_load(capfd, tmp_path):
    out = tmp_path / "bound.json"
    done = script_in_process(capfd, ROOT / "scripts" / "bench" / "agents_bound.py", "--loads", "0.5", "0.9",
                             "--turn-seconds", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert [row["load"] for row in figures["loads"]] == [0.5, 0.9]
    for row in figures["loads"]:
        assert row["ps_job_s"] > row["srpt_job_s"] > figures["tools_s"]
        assert f"| {row['load']:g} | {row['ps_job_s']:.2f} s |" in done.stdout
    assert figures["loads"][1]["ps_over_srpt_job"] > figures["loads"][0]["ps_over_srpt_job"]  # ordering pays with load
    bad = script_in_process(capfd, ROOT / "scripts" / "bench" / "agents_bound.py", "--loads", "1.5")
    assert bad.returncode == 2 and "--loads" in bad.stderr
