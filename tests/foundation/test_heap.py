"""heap.trim hands freed heap pages back: resident memory falls by what was freed in the middle
of the heap (which malloc alone keeps mapped), under glibc and under a preloaded tcmalloc; a
settled reading waits out buffers being freed."""
import ctypes.util
import os
import subprocess
import sys
import textwrap

import pytest

from ctopd_jax.common import heap

FREED_IN_THE_MIDDLE = textwrap.dedent("""
    from ctopd_jax.common import heap

    def resident():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    blocks = [b"x" * (64 * 1024) for _ in range(1600)]   # 100 MiB in blocks under the mmap threshold
    kept = blocks[::64]    # a live block every 4 MiB: no freed run reaches the top of the heap
    del blocks
    before = resident()
    print(heap.trim(), (before - resident()) // 2 ** 20)
""")


def freed_mib(preload: str | None) -> int:
    """Run the program above in a fresh process (its own heap), with `preload` as LD_PRELOAD."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env.update({"LD_PRELOAD": preload} if preload else {})
    out = subprocess.run([sys.executable, "-c", FREED_IN_THE_MIDDLE], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out[0] == "True"
    return int(out[1])


@pytest.mark.skipif(heap._MALLOC_TRIM is None, reason="no glibc malloc_trim here")
def test_trim_returns_the_freed_middle_of_the_heap():
    assert freed_mib(None) > 50


@pytest.mark.skipif(ctypes.util.find_library("tcmalloc_minimal") is None,
                    reason="tcmalloc is not installed (apt: libtcmalloc-minimal4)")
def test_trim_returns_tcmalloc_free_lists_when_it_is_preloaded():
    # glibc's malloc_trim cannot reach tcmalloc's free lists: heap.trim asks tcmalloc itself
    assert freed_mib(ctypes.util.find_library("tcmalloc_minimal")) > 50


def test_a_settled_reading_waits_out_buffers_being_freed_but_records_a_level_that_rose(monkeypatch):
    readings = iter([150, 140, 100, 200, 200, 200, 200, 200, 200])
    monkeypatch.setattr(heap, "resident_bytes", lambda: next(readings))
    monkeypatch.setattr(heap.time, "sleep", lambda s: None)
    assert heap.settled_resident_bytes(None) == 150        # no level yet: read once
    assert heap.settled_resident_bytes(100) == 100         # 140 after 150: still settling
    assert heap.settled_resident_bytes(100) == 200         # five more reads, then recorded
    assert next(readings, "spent") == "spent"
