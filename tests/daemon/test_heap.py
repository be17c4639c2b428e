"""headrace.daemon.heap against glibc's own malloc, each case in a fresh interpreter (malloc's settings are
the process's): what the settings change is measured, so each assertion fails without them."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from headrace.daemon import heap

pytestmark = pytest.mark.skipif(heap.usage() is None, reason="glibc >= 2.33's malloc only")

PRELUDE = """
import ctypes, json, sys
from headrace.daemon import heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
MIB = 1 << 20
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
"""


def run(body: str) -> dict:
    out = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout)


@pytest.mark.parametrize("tuned", [False, True])
def test_a_fixed_mmap_threshold_keeps_large_blocks_in_mappings_of_their_own(tuned: bool) -> None:
    got = run(f"""
        if {tuned}:
            heap.tune(0, 1024, 2048)
        libc.free(libc.malloc(8 * MIB))  # glibc's own threshold climbs past 8 MiB here
        before = heap.usage().mapped
        block = libc.malloc(4 * MIB)
        print(json.dumps({{"mapped": heap.usage().mapped - before}}))
    """)
    # Untuned, the 4 MiB block comes from the heap (kept resident once freed); tuned, it is mapped.
    assert (got["mapped"] >= 4 * 2**20) == tuned


def test_tune_reports_what_it_set_and_leaves_zeros_to_glibc() -> None:
    got = run("""print(json.dumps(heap.tune(0, 512, 0)))""")
    assert got == {"mmap_threshold_kib": 512}


def test_trim_returns_the_free_pages_between_live_blocks() -> None:
    got = run("""
        heap.tune(0, 1024, 2048)
        blocks = [libc.malloc(64 * 1024) for _ in range(2400)]  # 150 MiB under the mmap threshold
        for b in blocks:
            ctypes.memset(b, 1, 64 * 1024)
        for i, b in enumerate(blocks):
            if i % 16:  # every 16th stays: the free space between them cannot shrink from the top
                libc.free(b)
        usage, before = heap.usage(), rss()
        released = heap.trim()
        print(json.dumps({"free": usage.free, "released": released, "drop": before - rss()}))
    """)
    assert got["free"] >= 120 * 2**20
    assert got["released"] and got["drop"] >= 100 * 2**20


def test_usage_counts_live_blocks() -> None:
    got = run("""
        before = heap.usage().in_use
        blocks = [libc.malloc(32 * 1024) for _ in range(1024)]
        print(json.dumps({"grew": heap.usage().in_use - before}))
    """)
    assert got["grew"] >= 32 * 2**20
