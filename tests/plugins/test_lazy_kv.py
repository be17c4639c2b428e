"""Which pages a freed stream gives back (``lazy_kv.StreamLayout``): whatever the KV buffer's start in the run it
was found in, a stream's ranges lie inside that stream's slices and nobody else's, and a layout that disagrees
with llama.cpp's logged size is refused."""

from __future__ import annotations

import mmap

import pytest

from headrace.plugins.engines.llama_cpp.lazy_kv import MiB, ReleasedBuffer, stream_layout

PAGE = mmap.PAGESIZE
LAYERS, K_ROW, V_ROW, CELLS, STREAMS = 3, 384, 384, 2048, 5


def buffer_at(start: int, slack: int) -> tuple[ReleasedBuffer, int]:
    size = LAYERS * (K_ROW + V_ROW) * CELLS * STREAMS
    run = (start - start % PAGE, -(-(start + size + slack) // PAGE) * PAGE)  # resident pages: whole ones
    return ReleasedBuffer(run=run, logged_mib=round(size / MiB, 2), released=(run[0] + PAGE, run[1] - PAGE)), size


def slices(base: int, stream: int) -> list[tuple[int, int]]:
    out, offset = [], 0
    for _ in range(LAYERS):
        for row in (K_ROW, V_ROW):
            out.append((base + offset + stream * row * CELLS, base + offset + (stream + 1) * row * CELLS))
            offset += row * CELLS * STREAMS
    return out


@pytest.mark.parametrize("start, slack", [(0x7F00_0000_0040, 3 * PAGE), (0x7F00_0000_1000 + 64, 0),
                                          (0x7F00_0000_0010, PAGE + 100)])
def test_a_stream_s_ranges_hold_only_its_cells_wherever_the_buffer_starts(start, slack):
    buffer, size = buffer_at(start, slack)
    layout = stream_layout(buffer, LAYERS, K_ROW, V_ROW, CELLS, STREAMS)
    assert layout is not None and layout.size == size
    for stream in range(STREAMS):
        ranges = layout.ranges(stream)
        assert len(ranges) == 2 * LAYERS  # each slice is 192 pages: every one keeps most of them
        for base in range(buffer.run[0], buffer.run[1] - size + 1, 16):  # every start the run allows
            mine = slices(base, stream)
            for r0, r1 in ranges:
                assert r0 % PAGE == 0 and r1 % PAGE == 0
                assert buffer.released[0] <= r0 < r1 <= buffer.released[1]
                assert any(s0 <= r0 and r1 <= s1 for s0, s1 in mine), (stream, base, (r0, r1))
        released = sum(r1 - r0 for r0, r1 in ranges)
        assert released >= 2 * LAYERS * (K_ROW * CELLS - 3 * PAGE - slack)


def test_a_layout_that_disagrees_with_the_logged_size_is_refused():
    buffer, _ = buffer_at(0x7F00_0000_0040, PAGE)
    assert stream_layout(buffer, LAYERS, K_ROW, V_ROW, CELLS, STREAMS) is not None
    assert stream_layout(buffer, LAYERS + 1, K_ROW, V_ROW, CELLS, STREAMS) is None  # another model's rows
    assert stream_layout(buffer, LAYERS, K_ROW // 2, V_ROW, CELLS, STREAMS) is None  # a q8_0 K cache, say
