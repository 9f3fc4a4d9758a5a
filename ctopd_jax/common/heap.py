"""The host heap: handed back to the operating system after a compile, and read.

Compiling a program allocates a few hundred MB on the host (LLVM, the HLO passes) and frees it
when done; glibc's malloc keeps those freed pages mapped for reuse, so a process that compiled
stays that much larger (on the character pair, 0.69 GiB resident after the compiling steps, 0.49
GiB after a trim; benchmarks/trl_peer.py). `trim()` asks malloc to give them back; the loop calls
it after a step that compiled (trainer.step). Under tcmalloc (preloaded for long runs, README)
it asks tcmalloc instead, whose free lists glibc's trim cannot reach. Elsewhere it does nothing.

`settled_resident_bytes()` is what each metrics row records as `host_rss_bytes`
(common/metrics.py): the RSS once the step's last buffers are gone. XLA's runtime frees a
program's temporaries on its own threads just after the outputs are ready, so a reading taken at
once caught them in ~2 % of the rows (+140 MiB on the demo pair); one taken 10-50 ms later never
did.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import time

_LIBC = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None
_TCMALLOC_RELEASE = getattr(ctypes.CDLL(None), "MallocExtension_ReleaseFreeMemory", None)


def trim() -> bool:
    """Return the heap's free pages to the OS; True when malloc released any (tcmalloc does not
    say: True when asked)."""
    if _TCMALLOC_RELEASE is not None:
        _TCMALLOC_RELEASE()
        return True
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False


def resident_bytes() -> int | None:
    """This process's resident memory now (VmRSS), None where /proc does not say."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def settled_resident_bytes(level: int | None, waits: int = 5, pause_s: float = 0.01) -> int | None:
    """The resident memory once buffers being freed as a computation ends are gone: read again,
    `pause_s` apart and at most `waits` times, while more than 2 % above `level` (the previous
    such reading; None: read once). A level that truly rose is recorded after `waits * pause_s`."""
    reading = resident_bytes()
    for _ in range(waits if level else 0):
        if reading is None or reading <= 1.02 * level:
            break
        time.sleep(pause_s)
        reading = resident_bytes()
    return reading
