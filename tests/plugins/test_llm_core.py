"""llm.core's shared row sampling: the numpy path (llama.cpp's logits) picks what the torch sampler picks;
and the stream a row's deltas go to (``TokenStream``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headrace.plugins.engines.llm.core import Row, logprobs_row, sample_rows, sample_rows_numpy
from headrace.plugins.engines.llm.sampling import Detokenizer, make_generator
from headrace.plugins.protocols import SamplingParams

PARAMS = [SamplingParams(temperature=0.0, max_tokens=4), SamplingParams(temperature=1.0, seed=7, max_tokens=4),
          SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), SamplingParams(temperature=0.7, seed=3, top_p=0.5,
                                                                                   max_tokens=4)]


def rows() -> list[Row]:
    return [Row(ctx=f"c{i}", params=p, send=None, free_after=True, priority=0, generator=make_generator(p.seed),
                detok=Detokenizer(None), length=1) for i, p in enumerate(PARAMS)]


def test_numpy_rows_sample_as_the_torch_sampler_does_greedy_and_seeded_alike():
    logits = np.random.default_rng(0).standard_normal((len(PARAMS), 1000)).astype(np.float32)
    logits[0, 17] = logits[2, 998] = 50.0  # the greedy rows' answers, away from index 0
    got = sample_rows_numpy(rows(), logits)
    assert got == sample_rows(rows(), torch.from_numpy(logits.copy()))
    assert got[0] == 17 and got[2] == 998
    # Seeded rows really sample (a seed's draw is not the argmax for every seed): draws differ across seeds.
    draws = set()
    for seed in range(20):
        r = rows()[1]
        r.generator = make_generator(seed)
        draws.add(sample_rows_numpy([r], logits[1:2])[0])
    assert len(draws) > 1


def test_only_a_row_that_asked_for_logprobs_gets_its_logits_as_a_tensor():
    row = np.arange(5, dtype=np.float32)
    plain, wants = rows()[0], rows()[2]
    assert logprobs_row(plain, row) is None
    assert torch.equal(logprobs_row(wants, row), torch.from_numpy(row))


@pytest.mark.anyio
async def test_a_token_stream_wakes_its_reader_once_a_delivery_and_refuses_sends_after_it_ends():
    """The decode stream (``TokenStream``): what is sent comes in order, a reader waiting is woken, sends after
    ``close`` or after the reader left fail as a memory object stream's do (``deliver_on_loop`` drops them)."""
    import anyio

    from headrace.plugins.engines.llm.messages import Outbox, TokenStream, deliver_on_loop

    stream, got = TokenStream(), []

    async def read() -> None:
        async for item in stream:
            got.append(item)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        await anyio.wait_all_tasks_blocked()  # the reader waits on an empty stream
        stream.send_nowait(1)
        stream.send_nowait(2)
        await anyio.wait_all_tasks_blocked()
        assert got == [1, 2]
        deliver_on_loop(Outbox(deltas=[(stream, 3, True)]))  # the last delta: sent, then the stream closed
    assert got == [1, 2, 3]
    with pytest.raises(anyio.ClosedResourceError):
        stream.send_nowait(4)
    left = TokenStream()
    left.send_nowait(1)
    left.leave()
    with pytest.raises(anyio.BrokenResourceError):
        left.send_nowait(2)
    deliver_on_loop(Outbox(deltas=[(left, 2, True)]))  # the reader went away: dropped, no error
    assert [item async for item in left] == []
