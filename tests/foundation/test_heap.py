"""heap.trim hands freed heap pages back: resident memory falls by what was freed in the middle
of the heap (which malloc alone keeps mapped); a settled reading waits out buffers being
freed."""
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


def test_a_settled_reading_waits_out_buffers_being_freed_but_records_a_level_that_rose(monkeypatch):
    readings = iter([150, 140, 100, 200, 200, 200, 200, 200, 200])
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(readings))
    monkeypatch.setattr(heap.time, "sleep", lambda s: None)
    assert heap.settled_resident_bytes(None) == 150        # no level yet: read once
    assert heap.settled_resident_bytes(100) == 100         # 140 after 150: still settling
    assert heap.settled_resident_bytes(100) == 200         # five more reads, then recorded
    assert next(readings, "spent") == "spent"
