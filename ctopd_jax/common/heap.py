"""The host heap: held at a level over a long run, handed back after a compile, and read.

glibc's malloc serves a block above its mmap threshold (128 KiB at start) with a mapping of its
own and returns it when freed, but each such free raises the threshold (up to 32 MiB), after
which a step's buffers come from the heap, where freed pages stay resident as it fragments and
are trimmed off its top now and then: over a 1,000-step run of the demo pair the RSS at each
step's end climbed and fell by 40-150 MiB (benchmarks/RESULTS.md, "Reliability").
`hold_level()`, which every command calls first (common/cli.py), fixes the thresholds instead:
buffers of 4 MiB and more are mapped and returned whole, and the heap of smaller blocks keeps up
to 64 MiB free at its top for reuse. The step-end RSS is then level within ~2 % and ~9 % lower,
at ~3 % of the demo pair's step time; a real model's buffers are past 32 MiB and mapped either
way. A `MALLOC_MMAP_THRESHOLD_` or `MALLOC_TRIM_THRESHOLD_` in the environment wins.

Compiling a program allocates a few hundred MB on the host (LLVM, the HLO passes) and frees it
when done; glibc's malloc keeps those freed pages mapped for reuse, so a process that compiled
stays that much larger (on the character pair, 0.69 GiB resident after the compiling steps, 0.49
GiB after a trim; benchmarks/trl_peer.py). `trim()` asks malloc to give them back; the loop calls
it after a step that compiled (trainer.step). Elsewhere than glibc it does nothing.

`settled_resident_bytes()` is what each metrics row records as `host_rss_bytes`
(common/metrics.py): the RSS once the step's last buffers are gone. XLA's runtime frees a
program's temporaries on its own threads just after the outputs are ready, so a reading taken at
once caught them in ~2 % of the rows (+140 MiB on the demo pair); one taken 10-50 ms later never
did.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

_LIBC = ctypes.util.find_library("c")
_MALLOC_TRIM = getattr(ctypes.CDLL(_LIBC), "malloc_trim", None) if _LIBC else None
_MALLOPT = getattr(ctypes.CDLL(_LIBC), "mallopt", None) if _LIBC else None
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3         # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 4 * 2 ** 20
TRIM_THRESHOLD = 64 * 2 ** 20


def hold_level() -> bool:
    """Fix malloc's mmap and trim thresholds (see the module doc); False where this is not
    glibc or the environment already sets them."""
    if _MALLOPT is None or {"MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"} & set(os.environ):
        return False
    return bool(_MALLOPT(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        _MALLOPT(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


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
