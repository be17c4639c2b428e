"""The KV store's tiers on their own: budgets, lookups by prefix, and the files a restart finds or drops."""

from __future__ import annotations

import ctypes
import os
import random
from pathlib import Path

import pytest

from headrace.plugins.engines.kvreuse.kv_store import (MAGIC, OWN_MAPPING_PAYLOAD, SUFFIX, KVStore, block_digests,
                                                      payload_buffer)

BLOCK = 16


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(49152) for _ in range(n)]


def payload(seed: int, size: int) -> bytearray:
    return bytearray(random.Random(seed).randbytes(size))


def store(tmp_path: Path | None, host: int = 1 << 20, disk: int = 1 << 20, namespace: str = "model-a f16") -> KVStore:
    return KVStore(namespace, BLOCK, host, tmp_path, disk if tmp_path is not None else 0)


def test_the_longest_block_prefix_is_found_and_an_entry_answers_its_own_prefixes():
    s = store(None)
    long, other = tokens(1, 96), tokens(2, 64)
    s.put(long, payload(1, 1000))
    s.put(other, payload(2, 1000))
    hit = s.match(long[:70] + tokens(3, 30), 100)
    assert hit.tokens == 64 and hit.entry.tokens == long and hit.tier == "host"
    assert s.match(long, 95).tokens == 80  # at most max_tokens, whole blocks
    assert s.match(tokens(4, 64), 64) is None
    s.put(long[:48], payload(3, 10))  # already held by the longer entry: nothing new
    assert len(s) == 2


def test_host_memory_never_exceeds_its_budget_and_the_least_recently_used_go_first():
    s = store(None, host=10_000)
    prompts = [tokens(i, 32) for i in range(10)]
    for i, p in enumerate(prompts):
        s.put(p, payload(i, 3_000))
        assert s.host_used <= 10_000
        if i == 2:
            s.used(s.match(prompts[0], 32), 0.0)  # the first is used again: the second is now the oldest
        if i == 3:
            assert s.match(prompts[0], 32) is not None and s.match(prompts[1], 32) is None
    held = [i for i, p in enumerate(prompts) if s.match(p, 32) is not None]
    assert held == [7, 8, 9]
    assert s.stats()["kv_store_host_bytes"] == 9_000 and s.host.evictions == 7
    s.put(tokens(99, 32), payload(99, 20_000))  # larger than the whole budget: not kept, nothing evicted
    assert len(s) == 3


def test_a_longer_entry_supersedes_the_shorter_one_it_starts_with(tmp_path):
    s = store(tmp_path)
    base = tokens(5, 32)
    s.put(base, payload(5, 100))
    s.flush()
    s.put(base + tokens(6, 32), payload(6, 200))
    s.flush()
    assert len(s) == 1 and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 1
    s.close()


def test_entries_spill_to_disk_and_come_back_after_a_restart(tmp_path):
    s = store(tmp_path, host=2_500)
    prompts = [tokens(i, 48) for i in range(4)]
    for i, p in enumerate(prompts):
        s.put(p, payload(i, 1_000))
    s.close()
    assert s.host_used == 0
    again = store(tmp_path, host=2_500)
    assert len(again) == 4 and again.disk_used == 4_000
    for i, p in enumerate(prompts):
        hit = again.match(p, 48)
        assert hit.tier == "disk" and again.payload(hit) == payload(i, 1_000)
        again.used(hit, 0.001)
    assert again.host_used <= 2_500 and again.disk.hits == 4
    again.close()


def test_the_disk_budget_removes_the_least_recently_used_files(tmp_path):
    s = store(tmp_path, host=0, disk=2_500)
    for i in range(4):
        s.put(tokens(i, 32), payload(i, 1_000))
        s.flush()
    assert s.disk_used <= 2_500 and len(list(tmp_path.glob(f"*{SUFFIX}"))) == 2
    assert s.match(tokens(3, 32), 32) is not None and s.match(tokens(0, 32), 32) is None
    s.close()


@pytest.mark.parametrize("damage", ["truncated", "corrupted", "foreign", "torn", "not ours", "renamed"])
def test_a_bad_file_is_dropped_never_loaded(tmp_path, damage):
    s = store(tmp_path)
    good, bad = tokens(1, 32), tokens(2, 32)
    s.put(good, payload(1, 500))
    s.put(bad, payload(2, 500))
    s.close()
    path = tmp_path / f"{block_digests(bad, BLOCK)[-1].hex()}{SUFFIX}"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[:-10])
    elif damage == "corrupted":
        path.write_bytes(data[:-10] + bytes(10))
    elif damage == "torn":  # a crash mid-write leaves the partial file, never renamed into place
        path.rename(path.with_suffix(".partial"))
    elif damage == "not ours":
        path.write_bytes(b"GGUF" + data[4:])
    elif damage == "renamed":
        path.rename(tmp_path / f"{'0' * 32}{SUFFIX}")
    namespace = "model-b f16" if damage == "foreign" else "model-a f16"
    again = store(tmp_path, namespace=namespace)
    hit = again.match(bad, 32)
    if hit is not None:  # only a corruption inside the payload passes the scan: the read's checksum finds it
        assert damage == "corrupted" and again.payload(hit) is None and again.match(bad, 32) is None
    assert again.files_dropped == (2 if damage == "foreign" else 1)
    assert [p.name for p in tmp_path.iterdir()] == ([] if damage == "foreign" else
                                                     [f"{block_digests(good, BLOCK)[-1].hex()}{SUFFIX}"])
    if damage != "foreign":
        assert again.payload(again.match(good, 32)) == payload(1, 500)
    again.close()


def test_a_file_starts_with_the_format_and_carries_its_namespace(tmp_path):
    s = store(tmp_path, namespace="model-a f16 streams=56")
    s.put(tokens(1, 16), payload(1, 64))
    s.close()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    data = path.read_bytes()
    assert data.startswith(MAGIC) and b"model-a f16 streams=56" in data[:300]
    assert os.path.getsize(path) == len(data)


def _mapped(buffer) -> bool:
    """Whether ``buffer``'s memory is a mapping of its own in /proc/self/maps (starts it, page-aligned)."""
    address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    with open("/proc/self/maps") as f:
        return any(int(line.split("-")[0], 16) == address for line in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's /proc/self/maps")
def test_a_large_payload_has_a_mapping_of_its_own_from_a_put_and_from_a_file(tmp_path):
    # A host-tier entry of 1 MiB or more does not come from malloc's heaps, where entries leaving in another
    # order than they came leave holes the heap keeps; a small one does.
    small, large = payload_buffer(OWN_MAPPING_PAYLOAD - 1), payload_buffer(OWN_MAPPING_PAYLOAD)
    assert isinstance(small, bytearray) and not isinstance(large, bytearray) and _mapped(large)
    assert len(large) == OWN_MAPPING_PAYLOAD and bytes(large[:64]) == bytes(64)  # zeroed, as a bytearray is
    data = random.Random(5).randbytes(3 * OWN_MAPPING_PAYLOAD + 17)
    large = payload_buffer(len(data))
    large[:] = data
    s = store(tmp_path, host=4 * OWN_MAPPING_PAYLOAD, disk=8 * OWN_MAPPING_PAYLOAD)
    prompt = tokens(9, 64)
    s.put(prompt, large)
    s.close()
    again = store(tmp_path, host=4 * OWN_MAPPING_PAYLOAD, disk=8 * OWN_MAPPING_PAYLOAD)
    read = again.payload(again.match(prompt, 64))
    assert bytes(read) == data and _mapped(read)  # read back from its file into a mapping of its own
    again.close()
