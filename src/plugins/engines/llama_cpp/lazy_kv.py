"""KV cells that take memory only once they are used (issue 50): llama.cpp's KV buffer handed back to the kernel
right after the context is made, so the resident memory follows the cells sequences actually fill.

llama.cpp allocates a context's whole KV at once (every stream's cells: 56 streams x 2,048 cells of SmolLM2-135M
is 2.6 GB) and then writes zeros over all of it (``ggml_backend_buffer_clear``, "to avoid NaNs in the padding"),
which makes every page resident although a fresh anonymous mapping is zeros already. ``release_kv_buffers``
undoes that write: ``madvise(MADV_DONTNEED)`` on the buffer's pages drops them, and a page read again is a
fresh zero page (private anonymous memory), exactly what the clear wrote. A page comes back when a cell on it is
written, so an idle engine holds almost none of its KV and a busy one what its sequences filled (a sequence's
cells are the start of its stream: its prompt's length, not the stream's).

Which memory: the buffers llama.cpp says it made (its "KV buffer size = X MiB" log line while the context is
made, one a cache: a sliding-window model has two), each matched to a run of resident pages of its size
(``mincore``) in the anonymous mappings that appeared during that call and overlap nothing mapped before it.
Nothing else is touched: a run of another size, or two alike, is left alone, and no match releases nothing
(the engine runs as before, said in the log). Only a buffer of ``OWN_MAPPING_BYTES`` or more is released: glibc
serves an allocation that large from a mapping of its own, while a smaller one may lie in a heap among live
chunks whose pages a mistaken match would zero (a small context's KV is not worth that risk). Linux only
(``/proc/self/maps``); elsewhere nothing is released.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

log = logging.getLogger(__name__)

MADV_DONTNEED = 4
MiB = 1 << 20
KV_BUFFER_LINE = re.compile(r"KV buffer size\s*=\s*([0-9.]+)\s*MiB")
# The log prints MiB to two decimals; the mapping adds malloc's header and alignment, rounded up to pages.
SIZE_SLACK = int(0.006 * MiB) + 2 * mmap.PAGESIZE
# glibc's mmap threshold never rises above 32 MiB on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): twice that is always
# a mapping of its own, whatever the process freed before.
OWN_MAPPING_BYTES = 64 * MiB


@dataclass(frozen=True)
class ReleasedBuffer:
    """A KV buffer found and handed back: the resident run it was found in (it lies somewhere inside), its size
    as logged (MiB, two decimals), and the page range released (inside the buffer wherever it lies in the run)."""

    run: tuple[int, int]
    logged_mib: float
    released: tuple[int, int]


@dataclass(frozen=True)
class StreamLayout:
    """Where each stream's cells lie in a KV buffer of one stream per sequence: llama.cpp allocates a K and a V
    tensor a layer, in that order, each (row, cells, streams) with stream ``s`` its ``s``-th slice, back to back
    at ggml's 32-byte alignment. The buffer's start is known only to lie in ``run``: a stream's range is what
    every possible start covers, and never leaves ``inside`` (the range released at load)."""

    run: tuple[int, int]
    size: int  # the buffer's bytes, from the layout (checked against the logged size)
    tensors: tuple[tuple[int, int], ...]  # (offset in the buffer, bytes of one stream's slice), buffer order
    inside: tuple[int, int]

    def ranges(self, stream: int) -> list[tuple[int, int]]:
        """The whole pages holding only ``stream``'s cells, whatever the buffer's start in its run."""
        page = mmap.PAGESIZE
        earliest, latest = self.run[0], self.run[1] - self.size  # the buffer's possible starts
        out = []
        for offset, per_stream in self.tensors:
            start = -(-(latest + offset + stream * per_stream) // page) * page
            end = (earliest + offset + (stream + 1) * per_stream) // page * page
            start, end = max(start, self.inside[0]), min(end, self.inside[1])
            if end > start:
                out.append((start, end))
        return out


def stream_layout(buffer: ReleasedBuffer, layers: int, k_row: int, v_row: int, cells: int,
                  streams: int) -> StreamLayout | None:
    """The layout of ``buffer`` given the model's rows (bytes a cell, a layer) and the cells a stream; None when
    its total disagrees with llama.cpp's logged size (another cache type or layout: nothing is assumed)."""
    tensors, offset = [], 0
    for _ in range(layers):
        for row in (k_row, v_row):
            tensors.append((offset, row * cells))
            offset += -(-row * cells * streams // 32) * 32
    if abs(offset - buffer.logged_mib * MiB) > 0.0051 * MiB or offset > buffer.run[1] - buffer.run[0]:
        return None
    return StreamLayout(run=buffer.run, size=offset, tensors=tuple(tensors), inside=buffer.released)


def release_ranges(ranges: list[tuple[int, int]]) -> None:
    """``madvise(MADV_DONTNEED)`` each page range: read again, its pages are zeros (as llama.cpp cleared them)."""
    libc = _libc()
    for start, end in ranges:
        if libc.madvise(ctypes.c_void_p(start), end - start, MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise failed")


def anonymous_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's private anonymous read-write mappings (no file, not the stack)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 5 and parts[1] == "rw-p":  # no pathname: anonymous
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end))
    return out


def _new_ranges(before: list[tuple[int, int]], after: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``after``'s mappings that no mapping of ``before`` covered (an adjacent new mapping may merge
    with an old one in /proc/self/maps: only the new part is returned)."""
    out = []
    for start, end in after:
        pieces = [(start, end)]
        for b0, b1 in before:
            pieces = [p for s, e in pieces for p in ((s, min(e, b0)), (max(s, b1), e)) if p[1] > p[0]]
        out += pieces
    return out


@contextmanager
def kv_buffer_sizes(captured: list[float]) -> Iterator[None]:
    """While inside, the sizes (MiB) of the KV buffers llama.cpp logs from this thread go to ``captured``."""
    from headrace.plugins.engines.llama_cpp import files

    files.capture_log_lines(KV_BUFFER_LINE, captured)
    try:
        yield
    finally:
        files.capture_log_lines(None, captured)


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    return libc


def resident_bytes(ranges: list[tuple[int, int]]) -> int:
    """How much of ``ranges`` (page-aligned, as ``release_kv_buffers`` gives them) is in memory now (mincore)."""
    return sum(e - s for start, end in ranges for s, e in resident_runs(start, end))


def resident_runs(start: int, end: int) -> list[tuple[int, int]]:
    """The runs of resident pages in [start, end) (page-aligned), as (start, end) address ranges."""
    pages = (end - start) // mmap.PAGESIZE
    vec = (ctypes.c_ubyte * pages)()
    if _libc().mincore(ctypes.c_void_p(start), end - start, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    runs, first = [], None
    for i, page in enumerate(bytes(vec)):
        if page & 1 and first is None:
            first = i
        elif not page & 1 and first is not None:
            runs.append((start + first * mmap.PAGESIZE, start + i * mmap.PAGESIZE))
            first = None
    if first is not None:
        runs.append((start + first * mmap.PAGESIZE, end))
    return runs


# glibc's header of a chunk it mapped on its own (malloc.c): prev_size holds the chunk's offset in its mapping
# (posix_memalign moves the chunk up to its alignment), size the rest of the mapping with IS_MMAPPED set.
IS_MMAPPED, SIZE_BITS = 0x2, 0x7
HEADER_OFFSETS = range(0, 128, 16)  # where the header may sit in the mapping's first page (alignment <= 64)


def own_mapping(start: int, end: int, want: int,
                read_u64: Callable[[int], int] | None = None) -> tuple[int, int] | None:
    """The one mapping of ``want`` bytes or more that glibc made for a chunk of its own inside the resident run
    [start, end), found by its chunk header, or None (none, or more than one). /proc/self/maps merges adjacent
    anonymous mappings, so a neighbour's resident pages may lengthen the KV buffer's run; the header says where
    the buffer's own mapping begins and ends. Only pages of the run are read (resident, ours, read-write)."""
    read_u64 = read_u64 or (lambda address: ctypes.c_uint64.from_address(address).value)
    page, found = mmap.PAGESIZE, []
    for base in range(start, end - want + 1, page):
        for offset in HEADER_OFFSETS:
            if read_u64(base + offset) != offset:
                continue
            head = read_u64(base + offset + 8)
            size = head & ~SIZE_BITS
            if head & SIZE_BITS == IS_MMAPPED and (offset + size) % page == 0 and size - 16 >= want - SIZE_SLACK \
                    and base + offset + size <= end:
                found.append((base, base + offset + size))
                break
    return found[0] if len(found) == 1 else None


def release_kv_buffers(before: list[tuple[int, int]], sizes_mib: list[float], name: str) -> list[ReleasedBuffer]:
    """Hand back to the kernel the pages of each KV buffer of ``sizes_mib`` among the mappings made since
    ``before``; the buffers released (none where no buffer matched: said in the log).

    A KV buffer is found as a run of resident pages of its size: llama.cpp has just written zeros over all of it,
    while the other buffers the context made (compute, output) are not written yet, only their malloc header
    pages. A new mapping may merge with its neighbours in /proc/self/maps, which the runs see through. Released:
    only pages inside the buffer wherever it sits in the run, never its first page (malloc's chunk header, which
    free() reads) nor a neighbour's resident page (a release that zeroed another chunk's header aborted the
    process at that buffer's free)."""
    if not sys.platform.startswith("linux") or not sizes_mib:
        return []
    libc = _libc()
    runs = [run for s, e in _new_ranges(before, anonymous_mappings()) for run in resident_runs(s, e)]
    released = []
    for size in sizes_mib:
        want = int(size * MiB)
        if want < OWN_MAPPING_BYTES:
            continue  # may share a heap with live chunks: stays resident (it is small)
        match = [(s, e) for s, e in runs if want - SIZE_SLACK <= e - s <= want + SIZE_SLACK]
        if not match:  # a neighbour's resident pages joined the buffer's run: its own mapping, from malloc's header
            found = [(run, own) for run in runs if run[1] - run[0] > want + SIZE_SLACK
                     for own in [own_mapping(*run, want)] if own is not None]
            match = [own for _, own in found]
            if len(found) == 1:
                longer = found[0][0]
                runs[runs.index(longer)] = match[0]
                log.info("engine %s: the KV buffer of %.2f MiB found by its chunk header in a resident run %.1f MiB "
                         "longer", name, size, (longer[1] - longer[0] - (match[0][1] - match[0][0])) / MiB)
        if len(match) != 1:  # none, or ambiguous: leave the memory as it is
            log.warning("engine %s: the KV buffer of %.2f MiB was not found among the new mappings (%d candidates); "
                        "its memory stays resident", name, size, len(match))
            continue
        runs.remove(match[0])
        # The run may hold a few resident pages of a neighbour on either side: the buffer's header page starts
        # at most at run_end - size, at least at run_start, so only pages every such placement covers go.
        page, (r0, r1) = mmap.PAGESIZE, match[0]
        want = int((size - 0.005) * MiB)  # the logged size, rounded down
        start = (r1 - want) // page * page + page  # past the latest possible header page
        end = (r0 + want) // page * page  # before the earliest possible end of the buffer
        if end <= start:
            continue
        if libc.madvise(ctypes.c_void_p(start), end - start, MADV_DONTNEED) != 0:
            log.warning("engine %s: madvise of the KV buffer failed (errno %d); its memory stays resident", name,
                        ctypes.get_errno())
            continue
        released.append(ReleasedBuffer(run=(r0, r1), logged_mib=size, released=(start, end)))
    return released
