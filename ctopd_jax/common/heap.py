"""The host heap: handed back to the operating system after a compile, and read.

Compiling a program allocates a few hundred MB on the host (LLVM, the HLO passes) and frees it
when done; glibc's malloc keeps those freed pages mapped for reuse, so a process that compiled
stays that much larger (on the character pair, 0.69 GiB resident after the compiling steps, 0.49
GiB after a trim; benchmarks/trl_peer.py). `trim()` asks malloc to give them back; the loop calls
it after a step that compiled (trainer.step). Elsewhere than glibc it does nothing.

`resident_bytes()` is what each metrics row records as `host_rss_bytes` (common/metrics.py).
"""
from __future__ import annotations

import ctypes
import ctypes.util

_LIBC = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None


def trim() -> bool:
    """Return the heap's free pages to the OS; True when malloc released any."""
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
