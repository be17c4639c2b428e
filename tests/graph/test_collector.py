"""A request's output collector: a busy reader gets merged deltas, never loses a token, never stalls the run."""

from __future__ import annotations

import anyio
import pytest

from headrace.graph.collector import ChoiceCollector
from headrace.plugins.protocols import TokenDelta, TokenLogprob

pytestmark = pytest.mark.anyio


def token(i: int, finish=None) -> TokenDelta:
    return TokenDelta(text=f"t{i} ", token_ids=[i], finish_reason=finish, logprobs=(TokenLogprob(i, -0.5),))


async def test_output_put_while_nobody_reads_is_merged_per_choice_in_order():
    out = ChoiceCollector()
    for i in range(5):
        out.put(0, token(i))  # never waits: nobody is reading
        out.put(1, token(10 + i))
    out.put(0, token(5, finish="stop"))
    out.close()
    batches = [batch async for batch in out]
    assert len(batches) == 1
    first, second = batches[0]
    assert first.index == 0 and first.delta.token_ids == [0, 1, 2, 3, 4, 5] and first.delta.finish_reason == "stop"
    assert first.delta.text == "t0 t1 t2 t3 t4 t5 " and [lp.token_id for lp in first.delta.logprobs] == list(range(6))
    assert second.index == 1 and second.delta.token_ids == [10, 11, 12, 13, 14]


async def test_a_reader_as_fast_as_the_run_gets_each_delta_alone_and_the_end():
    out = ChoiceCollector()
    got = []

    async def read():
        async for batch in out:
            got.extend(c.delta.token_ids for c in batch)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            for i in range(4):
                out.put(0, token(i))
                await anyio.sleep(0.01)
            out.close()
    assert got == [[0], [1], [2], [3]]


async def test_nothing_is_taken_after_close_and_an_empty_close_ends_the_reader():
    out = ChoiceCollector()
    out.close()
    out.put(0, token(1))
    assert [batch async for batch in out] == []
