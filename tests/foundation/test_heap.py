"""heap.trim hands freed heap pages back: resident memory falls by what was freed in the middle
of the heap (which malloc alone keeps mapped); hold_level fixes malloc's thresholds, and a
settled reading waits out buffers being freed."""
import json
import os
import subprocess
import sys

import pytest

from ctopd_jax.common import heap

MIB = 2 ** 20


def resident() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(heap._MALLOC_TRIM is None, reason="no glibc malloc_trim here")
def test_trim_returns_the_freed_middle_of_the_heap():
    blocks = [b"x" * (64 * 1024) for _ in range(1600)]   # 100 MiB in blocks under the mmap threshold
    kept = blocks[::64]    # a live block every 4 MiB: no freed run reaches the top of the heap
    del blocks
    before = resident()
    assert heap.trim()
    assert before - resident() > 50 * MIB


PROBE = """
import ctypes, ctypes.util, json, sys
from ctopd_jax.common import heap
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
held = heap.hold_level() if sys.argv[1] == "hold" else None

def in_heap(address):   # inside the brk heap ([heap] in the maps), not a mapping of its own
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith("[heap]"):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            return lo <= address < hi
    return False

where = {}
for mib in (1, 8):
    first = libc.malloc(mib * 2 ** 20)
    libc.free(first)          # glibc's own rule: the freed size becomes its new mmap threshold
    again = libc.malloc(mib * 2 ** 20)
    where[mib] = in_heap(again)
    libc.free(again)
print(json.dumps({"held": held, "in_heap": where}))
"""


def probe(mode: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         check=True, env={**os.environ, **env})
    return json.loads(out.stdout)


@pytest.mark.skipif(heap._MALLOPT is None, reason="no glibc mallopt here")
def test_hold_level_maps_every_block_past_4_mib_where_malloc_alone_moves_them_into_the_heap():
    alone, held = probe("alone"), probe("hold")
    assert alone["in_heap"] == {"1": True, "8": True}     # the raised threshold: heap-served
    assert held == {"held": True, "in_heap": {"1": True, "8": False}}
    assert probe("hold", MALLOC_MMAP_THRESHOLD_="131072")["held"] is False   # the user's wins


def test_a_settled_reading_waits_out_buffers_being_freed_but_records_a_level_that_rose(monkeypatch):
    readings = iter([150, 140, 100, 200, 200, 200, 200, 200, 200])
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(readings))
    monkeypatch.setattr(heap.time, "sleep", lambda s: None)
    assert heap.settled_resident_bytes(None) == 150        # no level yet: read once
    assert heap.settled_resident_bytes(100) == 100         # 140 after 150: still settling
    assert heap.settled_resident_bytes(100) == 200         # five more reads, then recorded
    assert next(readings, "spent") == "spent"
