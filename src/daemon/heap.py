"""glibc malloc's settings for a long-lived daemon, its figures, and a periodic trim (``[memory]``).

glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB) and its trim threshold
to twice that, so after a few large transient buffers (a prompt's logits, a KV state, LanceDB's
batches) blocks of many MiB are carved from the heaps and each of the ~16 thread arenas keeps tens of
MiB free at its top without giving them back. Read from a soak's daemon (2026-11-30, gdb over
``main_arena``, its 14th minute): of 1,164 MiB in malloc's heaps 746 MiB were free, the threshold had
climbed to 20 MiB. Fixing both thresholds (``mallopt`` turns the adjustment off) and trimming every arena now and
then (``malloc_trim`` returns the free pages inside them too) bounds what freed memory stays resident.

Elsewhere (musl, macOS) none of this exists: ``tune`` and ``trim`` do nothing and ``usage`` is None.
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import anyio

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
KIB = 1024


class _MallInfo2(ctypes.Structure):
    # glibc >= 2.33's struct mallinfo2: every field a size_t.
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc() -> Any | None:
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        if hasattr(libc, "mallinfo2"):  # glibc >= 2.33
            libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _glibc()


@dataclass(frozen=True)
class HeapUsage:
    """malloc's bytes, every arena together (``mallinfo2``)."""

    in_use: int  # handed out from the heaps
    free: int  # the heaps' free blocks: resident until trimmed, and still counted after (glibc's fordblks)
    mapped: int  # blocks above the mmap threshold, each its own mapping (returned on free)


def usage() -> HeapUsage | None:
    """malloc's figures now; None without glibc >= 2.33. Locks each arena briefly in turn."""
    if _LIBC is None or not hasattr(_LIBC, "mallinfo2"):
        return None
    info = _LIBC.mallinfo2()
    return HeapUsage(in_use=info.uordblks, free=info.fordblks, mapped=info.hblkhd)


def tune(arena_max: int, mmap_threshold_kib: int, trim_threshold_kib: int) -> dict[str, int]:
    """Set malloc's limits (0 leaves glibc's own); what was set, by name. Call before threads start:
    glibc reads the arena limit when a thread first needs an arena of its own."""
    if _LIBC is None:
        return {}
    wanted = {"arena_max": (M_ARENA_MAX, arena_max, 1),
              "mmap_threshold_kib": (M_MMAP_THRESHOLD, mmap_threshold_kib, KIB),
              "trim_threshold_kib": (M_TRIM_THRESHOLD, trim_threshold_kib, KIB)}
    done = {}
    for name, (param, value, unit) in wanted.items():
        if value <= 0:
            continue
        if not _LIBC.mallopt(param, value * unit):  # glibc refuses an mmap threshold past 32 MiB
            log.warning("malloc refused %s = %d; glibc's own setting stays", name, value)
            continue
        done[name] = value
    return done


def trim() -> bool:
    """Return every arena's whole free pages to the system; whether any were. Takes each arena's lock
    in turn while it walks that arena's free blocks (milliseconds for a GB of heap): run off the loop."""
    return bool(_LIBC is not None and _LIBC.malloc_trim(0))


async def trim_every(seconds: float, took: Callable[[float], None] = lambda seconds: None, *,
                     task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
    """Trim every ``seconds`` until cancelled, telling ``took`` how long each trim held the arenas;
    0: never (returns at once)."""
    task_status.started()
    if seconds <= 0 or _LIBC is None:
        return
    while True:
        await anyio.sleep(seconds)
        start = time.perf_counter()
        await anyio.to_thread.run_sync(trim)
        took(time.perf_counter() - start)
