"""KV in tiers below an engine's cells: host memory, then files that survive a restart.

Engine-neutral, as vLLM's KV connectors are: an entry is the KV of a block-aligned token prefix as the
engine serialises it (llama.cpp's per-sequence state; a torch core's tensors as bytes), opaque here. An
engine puts an entry when a cached prefix leaves its cells, and before it prefills a prompt asks for the
longest prefix the tiers hold; an entry of n tokens answers any block-aligned prefix of them (the
engine restores it and trims the rest).

- **Host memory** holds entries under a byte budget, least recently used out first. An entry leaving it
  is already on disk (below) or is lost.
- **Disk** (optional): every entry put is written to a file under the store's directory by a writer
  thread, off the engine's step, under a byte budget of its own (least recently used files go). A file
  is a header (format, the store's namespace, token count, payload size, an XXH3-128 checksum of tokens
  and payload), the token ids, the payload. The namespace names the model file's content and the
  engine's KV layout: a file another model or layout wrote is stale and dropped, as is a torn or
  truncated one (its size) or a corrupted one (its checksum, verified at every read). A new store
  indexes the files already in its directory, so a restarted daemon finds what the last one saved.

Keys are chained BLAKE2b digests of token blocks (stable across processes, unlike ``hash``), so
one digest names a whole prefix, as in ``prefix_cache``; a match also compares the tokens.

Every entry belongs to a partition (``prefix_cache``: the requests that may reuse it, "" the shared one),
which seeds its first digest and is written in its file's header: after a restart an entry still answers
only its own partition's lookups.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import psutil
import xxhash

from headrace.private_files import open_private, private_dir

log = logging.getLogger(__name__)

MAGIC = b"HRKVSTO1"  # the file format; another value is a foreign file
_LENGTH = struct.Struct("<I")  # the header's length, after the magic
SUFFIX = ".kv"
_WRITE_QUEUE = 64  # entries waiting for the writer at most; past that a put does not wait, it skips the file


MiB = 1 << 20
# A payload this large gets a mapping of its own (payload_buffer): freed, its memory goes back to the kernel.
OWN_MAPPING_PAYLOAD = 1 * MiB
# Defaults sized from the machine when the engine loads: llama-server keeps 8 GiB of prompts in RAM by default;
# here at most a tenth of the memory then available, and a tenth of the data dir's free disk, up to 32 GiB.
HOST_SHARE, HOST_MAX = 0.10, 8192 * MiB
DISK_SHARE, DISK_MAX = 0.10, 32768 * MiB


def payload_buffer(size: int) -> bytearray | mmap.mmap:
    """A zeroed, writable buffer of ``size`` bytes for a KV payload (ctypes and files read and write it in place).

    From ``OWN_MAPPING_PAYLOAD`` up, a private anonymous mapping of its own rather than malloc's: host-tier entries
    are 1-50 MB, live for minutes and leave in another order than they came, and glibc serves them from its heaps
    once its mmap threshold has risen past them (a freed mapped chunk raises it, up to 32 MiB), where freed ones
    leave holes the heap keeps (``scripts/bench/kv_host_memory.py``). A mapping is returned whole when its last
    reference goes."""
    if size < OWN_MAPPING_PAYLOAD:
        return bytearray(size)
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def default_host_bytes() -> int:
    return int(min(HOST_MAX, HOST_SHARE * psutil.virtual_memory().available))


def default_disk_bytes(directory: Path) -> int:
    private_dir(directory)
    return int(min(DISK_MAX, DISK_SHARE * psutil.disk_usage(str(directory)).free))


def mebibytes(value: Any, key: str) -> int | None:
    """A tier's budget as configured, in MiB (as llama-server's ``--cache-ram``), in bytes; None (absent): sized
    from the machine at load (above)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}: must be an integer >= 0 (MiB; 0 turns the tier off), not {value!r}")
    return value << 20


def block_digests(tokens: Sequence[int], block: int, partition: str = "") -> list[bytes]:
    """The chained digest of every whole block of ``tokens``: entry ``i`` names ``tokens[: (i + 1) * block]`` in
    ``partition``."""
    ids = np.asarray(tokens[: len(tokens) // block * block], dtype=np.int64).tobytes()
    h = hashlib.blake2b(b"partition\0" + partition.encode(), digest_size=16).digest() if partition else b""
    out, width = [], block * 8
    for start in range(0, len(ids), width):
        h = hashlib.blake2b(h + ids[start : start + width], digest_size=16).digest()
        out.append(h)
    return out


def checksum(tokens: np.ndarray, payload: bytes | bytearray | memoryview) -> str:
    # XXH3-128: a corruption check, not a signature, at ~5 GB/s (BLAKE2b took 116 ms of a 46 MB restore here).
    h = xxhash.xxh3_128(tokens.tobytes())
    h.update(payload)
    return h.hexdigest()


@dataclass(eq=False)
class StoredPrefix:
    """An entry: the KV of ``tokens`` (block-aligned). ``payload`` is None when only its file holds it."""

    key: bytes  # the digest of all its tokens
    tokens: list[int]
    size: int  # payload bytes
    payload: bytearray | None = None
    digests: list[bytes] = field(default_factory=list)  # of each of its block prefixes (the last is ``key``)
    path: Path | None = None  # its file, once written
    queued: bool = False  # waiting for the disk writer
    last_used: float = 0.0
    partition: str = ""  # the requests it may answer (module docstring)


@dataclass(frozen=True)
class StoreHit:
    entry: StoredPrefix
    tokens: int  # how many of the prompt's tokens it answers
    tier: str  # "host" or "disk"


@dataclass
class TierStats:
    hits: int = 0  # lookups it answered
    hit_tokens: int = 0  # prompt tokens it answered
    restore_seconds: float = 0.0  # reading it back (disk) and the engine restoring it
    puts: int = 0
    evictions: int = 0


@dataclass
class KVStore:
    """The tiers of one engine's KV. ``host_bytes`` 0: no host tier; ``disk_dir`` None or ``disk_bytes`` 0:
    no disk tier. Thread-safe: the engine's worker and the writer thread share it."""

    namespace: str  # the model file's content and the engine's KV layout
    block: int
    host_bytes: int
    disk_dir: Path | None = None
    disk_bytes: int = 0
    clock: Callable[[], float] = time.monotonic
    host: TierStats = field(default_factory=TierStats)
    disk: TierStats = field(default_factory=TierStats)
    files_dropped: int = 0  # torn, truncated, corrupted, foreign or stale files found and removed
    host_used: int = 0
    disk_used: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._entries: OrderedDict[bytes, StoredPrefix] = OrderedDict()  # every entry in any tier, LRU first
        self._index: dict[bytes, StoredPrefix] = {}  # block digest -> the freshest entry holding that prefix
        self._writes: queue.Queue[StoredPrefix | None] = queue.Queue(_WRITE_QUEUE)
        self._writer: threading.Thread | None = None
        if self.disk_dir is not None and self.disk_bytes > 0:
            private_dir(self.disk_dir)  # 0700, its files 0600: they encode users' prompts
            self._scan()
            self._writer = threading.Thread(target=self._write_loop, name="kv-store-writer", daemon=True)
            self._writer.start()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def on_disk(self) -> bool:
        return self._writer is not None

    # ----- lookups -------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], max_tokens: int, partition: str = "") -> StoreHit | None:
        """The longest block-aligned prefix of ``tokens`` (at most ``max_tokens``) an entry of ``partition`` holds.
        Counts nothing."""
        digests = block_digests(tokens[: max(0, max_tokens)], self.block, partition)
        with self._lock:
            for i in range(len(digests) - 1, -1, -1):
                entry = self._index.get(digests[i])
                n = (i + 1) * self.block
                if entry is not None and entry.partition == partition and entry.tokens[:n] == list(tokens[:n]):
                    return StoreHit(entry, n, "host" if entry.payload is not None else "disk")
        return None

    def payload(self, hit: StoreHit) -> bytearray | None:
        """The entry's KV, read back from its file if only the file holds it (and kept in host memory again);
        None if the file is bad (dropped) or gone."""
        entry = hit.entry
        with self._lock:
            data = entry.payload
        if data is None:
            data = self._read(entry)
            if data is None:
                return None
            with self._lock:
                if entry.key in self._entries and entry.payload is None and self.host_bytes >= entry.size:
                    entry.payload = data
                    self.host_used += entry.size
                    self._fit_host()
        return data

    def used(self, hit: StoreHit, seconds: float) -> None:
        """Count a hit the engine restored in ``seconds`` (reading included)."""
        stats = self.host if hit.tier == "host" else self.disk
        with self._lock:
            stats.hits += 1
            stats.hit_tokens += hit.tokens
            stats.restore_seconds += seconds
            if hit.entry.key in self._entries:
                self._refresh(hit.entry)

    # ----- puts ----------------------------------------------------------------------------

    def holds(self, tokens: Sequence[int], partition: str = "") -> bool:
        hit = self.match(tokens, len(tokens), partition)
        return hit is not None and hit.tokens == len(tokens)

    def put(self, tokens: Sequence[int], payload: bytearray, partition: str = "") -> None:
        """Keep ``payload``, the KV of ``tokens`` (block-aligned) in ``partition``, in host memory and (queued) on
        disk."""
        tokens = list(tokens)
        if not tokens or len(tokens) % self.block:
            return
        if len(payload) > max(self.host_bytes, self.disk_bytes if self.on_disk else 0):
            return
        digests = block_digests(tokens, self.block, partition)
        entry = StoredPrefix(digests[-1], tokens, len(payload), digests=digests, partition=partition)
        with self._lock:
            held = self._index.get(entry.key)
            if held is not None and held.partition == partition and held.tokens[: len(tokens)] == tokens:
                return  # an entry already answers for all of it (the lookup ``holds`` makes, digests reused)
            self._add(entry)
            if self.host_bytes >= entry.size:
                entry.payload = payload
                self.host_used += entry.size
                self.host.puts += 1
        if self.on_disk:
            entry.queued = True  # until written, host memory may drop the entry's payload but not the entry
            try:
                self._writes.put_nowait(_Pending(entry, payload))
            except queue.Full:
                entry.queued = False
                log.warning("kv store: the disk writer is %d entries behind; %d tokens not written",
                            _WRITE_QUEUE, len(tokens))
        with self._lock:
            self._fit_host()

    def _add(self, entry: StoredPrefix) -> None:
        # An entry whose tokens begin the new one answers nothing the new one does not: it goes.
        for old in [e for e in self._entries.values()
                    if e.partition == entry.partition and e.tokens == entry.tokens[: len(e.tokens)]]:
            self._remove(old, delete_file=True)
        self._entries[entry.key] = entry
        self._refresh(entry)

    def _refresh(self, entry: StoredPrefix) -> None:
        self._entries.move_to_end(entry.key)
        entry.last_used = self.clock()
        for d in entry.digests:
            self._index[d] = entry

    def _fit_host(self) -> None:
        for entry in list(self._entries.values()):
            if self.host_used <= self.host_bytes:
                return
            if entry.payload is None:
                continue
            entry.payload = None
            self.host_used -= entry.size
            self.host.evictions += 1
            if entry.path is None and not entry.queued:
                self._remove(entry, delete_file=False)

    def _remove(self, entry: StoredPrefix, delete_file: bool) -> None:
        self._entries.pop(entry.key, None)
        if entry.payload is not None:
            self.host_used -= entry.size
            entry.payload = None
        for d in entry.digests:
            if self._index.get(d) is entry:
                del self._index[d]
        # Another entry may hold some of these blocks: index them to it (the freshest wins, as it is refreshed last).
        for other in self._entries.values():
            for d in other.digests:
                if self._index.get(d) is None:
                    self._index[d] = other
        if entry.path is not None:
            self.disk_used -= entry.size
            if delete_file:
                entry.path.unlink(missing_ok=True)
            entry.path = None

    # ----- disk ------------------------------------------------------------------------------

    def _file_for(self, key: bytes) -> Path:
        return self.disk_dir / f"{key.hex()}{SUFFIX}"

    def _write_loop(self) -> None:
        while (pending := self._writes.get()) is not None:
            try:
                self._write(pending.entry, pending.payload)
            except OSError as exc:
                log.warning("kv store: could not write an entry of %d tokens: %s", len(pending.entry.tokens), exc)
            finally:
                pending.entry.queued = False
                self._writes.task_done()
        self._writes.task_done()

    def _write(self, entry: StoredPrefix, payload: bytearray) -> None:
        with self._lock:
            if entry.key not in self._entries:
                return  # superseded before its turn
        ids = np.asarray(entry.tokens, dtype=np.int64)
        header = json.dumps({"namespace": self.namespace, "partition": entry.partition, "tokens": len(ids),
                             "payload": len(payload), "checksum": checksum(ids, payload)}).encode()
        path = self._file_for(entry.key)
        partial = path.with_suffix(".partial")
        with open_private(partial) as f:
            f.write(MAGIC + _LENGTH.pack(len(header)) + header)
            f.write(ids.tobytes())
            f.write(payload)
        os.replace(partial, path)  # a file is whole or absent; a torn one (a crash mid-write) stays .partial
        with self._lock:
            if entry.key not in self._entries:
                path.unlink(missing_ok=True)
                return
            entry.path = path
            self.disk_used += entry.size
            self.disk.puts += 1
            self._fit_disk()

    def _fit_disk(self) -> None:
        for entry in list(self._entries.values()):
            if self.disk_used <= self.disk_bytes:
                return
            if entry.path is None:
                continue
            entry.path.unlink(missing_ok=True)
            entry.path = None
            self.disk_used -= entry.size
            self.disk.evictions += 1
            if entry.payload is None:
                self._remove(entry, delete_file=False)

    def _header(self, f) -> tuple[dict, int] | None:
        """The file's header and where its tokens start, or None if it is not this store's format."""
        if f.read(len(MAGIC)) != MAGIC:
            return None
        raw = f.read(_LENGTH.size)
        if len(raw) != _LENGTH.size:
            return None
        (length,) = _LENGTH.unpack(raw)
        try:
            header = json.loads(f.read(length))
        except ValueError:
            return None
        if not isinstance(header, dict) or not {"namespace", "tokens", "payload", "checksum"} <= header.keys():
            return None
        return header, len(MAGIC) + _LENGTH.size + length

    def _drop_file(self, path: Path, why: str) -> None:
        log.warning("kv store: dropping %s (%s)", path.name, why)
        path.unlink(missing_ok=True)
        self.files_dropped += 1

    def _scan(self) -> None:
        """Index the files a previous daemon left, oldest first (by modification time)."""
        for stale in self.disk_dir.glob("*.partial"):
            self._drop_file(stale, "a write that never finished")
        files = sorted(self.disk_dir.glob(f"*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in files:
            try:
                with open(path, "rb") as f:
                    parsed = self._header(f)
                    if parsed is None:
                        self._drop_file(path, "not a KV store file")
                        continue
                    header, start = parsed
                    if header["namespace"] != self.namespace:
                        self._drop_file(path, "written for another model or KV layout")
                        continue
                    partition = header.get("partition", "")  # absent: written before partitions, the shared one
                    if not isinstance(partition, str):
                        self._drop_file(path, "its partition is not a string")
                        continue
                    ids = np.frombuffer(f.read(8 * header["tokens"]), dtype=np.int64)
                expected = start + 8 * header["tokens"] + header["payload"]
                if len(ids) != header["tokens"] or path.stat().st_size != expected:
                    self._drop_file(path, "truncated")
                    continue
            except OSError as exc:
                self._drop_file(path, f"unreadable: {exc}")
                continue
            tokens = ids.tolist()
            digests = block_digests(tokens, self.block, partition)
            if not digests or len(tokens) % self.block or path.name != f"{digests[-1].hex()}{SUFFIX}":
                self._drop_file(path, "its name does not match its tokens")
                continue
            entry = StoredPrefix(digests[-1], tokens, header["payload"], digests=digests, path=path,
                                 partition=partition)
            self._add(entry)
            self.disk_used += entry.size
        self._fit_disk()

    def _read(self, entry: StoredPrefix) -> bytearray | None:
        path = entry.path
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                parsed = self._header(f)
                ok = (parsed is not None and parsed[0]["namespace"] == self.namespace
                      and parsed[0].get("partition", "") == entry.partition)
                if ok:
                    header, _ = parsed
                    ids = np.frombuffer(f.read(8 * header["tokens"]), dtype=np.int64)
                    data = payload_buffer(header["payload"])
                    ok = (f.readinto(data) == len(data) and not f.read(1) and ids.tolist() == entry.tokens
                          and checksum(ids, data) == header["checksum"])
        except OSError:
            ok = False
        if not ok:
            with self._lock:
                self._remove(entry, delete_file=False)
                self._drop_file(path, "its checksum, size or header does not match")
            return None
        return data

    # ----- lifetime ------------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued entry is on disk."""
        if self.on_disk:
            self._writes.join()

    def clear(self) -> None:
        """Drop every entry, in host memory and on disk (a reset: the engine's prefix caching switched off)."""
        self.flush()
        with self._lock:
            for entry in list(self._entries.values()):
                self._remove(entry, delete_file=True)

    def close(self) -> None:
        """Write what is queued, then stop the writer. Host memory is given back."""
        if self._writer is not None:
            self._writes.put(None)
            self._writer.join()
            self._writer = None
        with self._lock:
            for entry in self._entries.values():
                entry.payload = None
            self.host_used = 0

    def stats(self) -> dict[str, float]:
        """The ``kv_store_*`` keys of an engine's stats (what /metrics reads)."""
        with self._lock:
            out: dict[str, float] = {"kv_store_files_dropped": self.files_dropped,
                                     "kv_store_host_bytes": self.host_used, "kv_store_host_capacity": self.host_bytes,
                                     "kv_store_disk_bytes": self.disk_used,
                                     "kv_store_disk_capacity": self.disk_bytes if self.on_disk else 0}
            for tier, s in (("host", self.host), ("disk", self.disk)):
                out.update({f"kv_store_{tier}_hits": s.hits, f"kv_store_{tier}_hit_tokens": s.hit_tokens,
                            f"kv_store_{tier}_restore_seconds": s.restore_seconds,
                            f"kv_store_{tier}_puts": s.puts, f"kv_store_{tier}_evictions": s.evictions})
        return out


@dataclass
class _Pending:
    entry: StoredPrefix
    payload: bytearray  # its own reference: host memory may drop the entry's payload before the write


def open_store(namespace: str, block: int, directory: Path, host_bytes: int | None, disk_bytes: int | None,
               name: str) -> KVStore | None:
    """An engine's store: budgets None sized from the machine, 0 off; None when both tiers are off."""
    host = default_host_bytes() if host_bytes is None else host_bytes
    disk = default_disk_bytes(directory) if disk_bytes is None else disk_bytes
    if host == 0 and disk == 0:
        return None
    store = KVStore(namespace, block, host, directory if disk else None, disk)
    if store.files_dropped:
        log.warning("engine %s: %d bad KV files dropped from %s", name, store.files_dropped, directory)
    log.info("engine %s: KV tiers: host memory %d MiB, disk %d MiB (%s, %d entries found)", name, host >> 20,
             disk >> 20, directory, len(store))
    return store


class EngineTiers:
    """What an engine's side of the store shares: a cached prefix leaving its cache is saved (``save``, the
    engine's own serialisation), and at stop the cache's prefixes go to the tiers before the store closes."""

    store: KVStore

    def save(self, kv: Any, tokens: Sequence[int], partition: str = "") -> None:
        raise NotImplementedError

    def offload(self, entry: Any, reason: str) -> None:
        """``PrefixCache.on_leave``: the entry goes to the tiers (in its partition), unless a longer one holding
        it came."""
        if reason != "superseded":
            # The tiers keep whole blocks (an entry holds one at least): a partial last block (``to_the_token``)
            # stays in the saved KV unnamed, and a restore cuts what it holds past its hit.
            whole = len(entry.tokens) // self.store.block * self.store.block
            self.save(entry.kv, entry.tokens[:whole], entry.partition)

    def close(self, cache: Any) -> None:
        """The cache's prefixes (a ``PrefixCache`` or None) go to the tiers (and disk, for the next start); the
        store closes."""
        if cache is not None:
            cache.clear()
        self.store.close()
