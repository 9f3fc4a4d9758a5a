"""A run's output folders: usable before any work starts, one run at a time, and a refused
write reported as one line.

    check_writable(path, "output_dir")        # preflight: a folder, or creatable, and writable
    check_not_in_use(output_dir)              # preflight: no live run holds the folder
    with RunLock(output_dir):                 # train.py, the writing process only
        ... train ...
    except OSError as err: raise write_error(err, {"output_dir": out, ...})

Decisions:
- Writability is judged without writing (preflight writes nothing): the folder, or its nearest
  existing parent when it does not exist yet, must be a directory on a file system mounted
  read-write (`statvfs`; root passes `os.access` even there) that `os.access` lets us write.
- The lock is `<output_dir>/.run.lock`, created with O_EXCL and holding the owner's pid, host
  and start time. A lock whose pid is dead on this host, or now belongs to a process started
  later (pid reuse), is stale (a killed run): it is taken over with a warning (renamed away
  first, so two runs cannot both take it). A lock from
  another host cannot be judged and refuses the run; the message names the file to remove.
- Releasing removes the lock, and the folders the lock itself created when they stayed empty
  (a run refused after preflight leaves nothing behind).
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
import time
import warnings
from pathlib import Path

LOCK_NAME = ".run.lock"
# What the file system says when it refuses a write: the errno names, and how libraries in
# other languages spell them inside their exceptions: tensorstore in Orbax's ValueError
# ("... No space left on device [os_error_code='28']"), Rust's io::Error in safetensors'
# ("IoError(Os { code: 28, kind: StorageFull, ... })").
DISK_ERRNOS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
               errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
               errno.EPERM: "operation not permitted", errno.EFBIG: "file too large"}
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)|\bOs \{ code: (\d+)")


class RunDirError(ValueError):
    """An output folder that cannot be used; the message names the field, the path and the fix."""


def disk_errno(err: BaseException | None) -> int | None:
    """The errno of a refused write (DISK_ERRNOS) carried by `err` or its causes, else None."""
    while err is not None:
        if isinstance(err, OSError) and err.errno in DISK_ERRNOS:
            return err.errno
        match = _OS_ERROR_CODE.search(str(err))
        code = int(match.group(1) or match.group(2)) if match else None
        if code in DISK_ERRNOS:
            return code
        err = err.__cause__ or err.__context__
    return None


# ----------------------------------------------------------------------------- writable

def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_writable(path: str | Path, field: str) -> None:
    """`path` is (or can be created as) a folder this process may write; RunDirError otherwise."""
    path = Path(path).absolute()
    existing = _nearest_existing(path)
    if not existing.is_dir():
        raise RunDirError(f"{field} {path}: {existing} is a file, not a folder; choose another "
                          f"{field} (or move the file away)")
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        raise RunDirError(f"{field} {path}: {existing} is on a read-only file system; point "
                          f"{field} at a writable disk")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RunDirError(f"{field} {path}: permission denied to write in {existing}; choose a "
                          f"{field} you may write, or fix its permissions")


# ----------------------------------------------------------------------------- one run per folder

def _read_lock(lock: Path) -> dict | None:
    """The lock's owner, {} when the file is unreadable or half-written, None when absent."""
    try:
        owner = json.loads(lock.read_text(encoding="utf-8"))
        return owner if isinstance(owner, dict) else {}
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True


def _start_ticks(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat field 22), which
    tells the lock's owner from a later process given the same pid (a restarted container
    often hands the trainer the same small pid); None where /proc does not say."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _is_stale(owner: dict) -> bool:
    """A lock of a process that is gone: same host, and its pid no longer runs or now belongs
    to a process started at another time."""
    pid = owner.get("pid")
    if owner.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    if not _alive(pid):
        return True
    ticks = owner.get("start_ticks")
    return ticks is not None and _start_ticks(pid) not in (None, ticks)


def _in_use(output_dir: Path, owner: dict) -> RunDirError:
    lock = output_dir / LOCK_NAME
    who = (f"pid {owner.get('pid')} on host {owner.get('host')} since {owner.get('started')}"
           if owner else "an unknown process")
    return RunDirError(f"output_dir {output_dir} is in use by another run ({who}); wait for it "
                       f"to finish or choose another output_dir (if that run is gone, remove "
                       f"{lock})")


def check_not_in_use(output_dir: str | Path) -> None:
    """RunDirError when a live run holds `output_dir` (a stale lock passes: RunLock takes it)."""
    output_dir = Path(output_dir).absolute()
    owner = _read_lock(output_dir / LOCK_NAME)
    if owner is not None and not _is_stale(owner):
        raise _in_use(output_dir, owner)


class RunLock:
    """`with RunLock(output_dir):` holds `<output_dir>/.run.lock` for the run (module doc)."""

    def __init__(self, output_dir: str | Path):
        self.output_dir = Path(output_dir).absolute()
        self.path = self.output_dir / LOCK_NAME
        self._created: list[Path] = []

    def acquire(self) -> "RunLock":
        missing = []
        parent = self.output_dir
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self._created = missing   # deepest first: the order to remove them in
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "start_ticks": _start_ticks(os.getpid())}
        for _ in range(2):        # a second try after taking over a stale lock
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                held = _read_lock(self.path) or {}
                if not _is_stale(held):
                    self._remove_created()
                    raise _in_use(self.output_dir, held) from None
                self._take_over(held)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(owner))
            return self
        self._remove_created()
        raise _in_use(self.output_dir, _read_lock(self.path) or {})

    def _take_over(self, held: dict) -> None:
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)   # atomic: of two runs taking over, one wins
        except FileNotFoundError:
            return
        aside.unlink(missing_ok=True)
        warnings.warn(f"output_dir {self.output_dir}: taking over the lock of pid {held.get('pid')} "
                      f"(started {held.get('started')}), which is no longer running",
                      RuntimeWarning, stacklevel=3)

    def release(self) -> None:
        owner = _read_lock(self.path)
        if owner and owner.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self._remove_created()

    def _remove_created(self) -> None:
        for path in self._created:
            try:
                path.rmdir()          # only when empty
            except OSError:
                break
        self._created = []

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# ----------------------------------------------------------------------------- refused writes

def write_error(err: BaseException, fields: dict[str, str | Path]) -> RunDirError | None:
    """One line for a write the file system refused (no space, read-only, permission): the
    field whose folder holds the path (the most specific one), the path and the fix; None when
    `err` is no such error."""
    code = disk_errno(err)
    if code is None:
        return None
    folders = {name: Path(p).absolute() for name, p in fields.items()}
    path = Path(getattr(err, "filename", None) or next(iter(folders.values()))).absolute()
    holding = [name for name, folder in folders.items() if folder == path or folder in path.parents]
    field = max(holding, key=lambda name: len(folders[name].parts)) if holding else next(iter(folders))
    fix = ("free space (or choose a folder on a larger disk), then continue with --resume"
           if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG) else f"choose a {field} you may write")
    return RunDirError(f"{field}: {path}: {DISK_ERRNOS[code]} ({errno.errorcode[code]}); {fix}")
