"""The host heap the XLA compiler frees, handed back to the operating system.

Compiling a program allocates a few hundred MB on the host (LLVM, the HLO passes) and frees it
when done; glibc's malloc keeps those freed pages mapped for reuse, so a process that compiled
stays that much larger (on the character pair, 0.69 GiB resident after the compiling steps, 0.49
GiB after a trim; benchmarks/trl_peer.py). `trim()` asks malloc to give them back; the loop calls
it after a step that compiled (trainer.step). Elsewhere than glibc it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util

_LIBC = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None


def trim() -> bool:
    """Return the heap's free pages to the OS; True when malloc released any."""
    return bool(_MALLOC_TRIM(0)) if _MALLOC_TRIM is not None else False
