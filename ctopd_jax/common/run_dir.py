"""A run's output folders: usable before any work starts, one run at a time, and a refused
write reported as one line.

    check_writable(path, "output_dir")        # preflight: a folder, or creatable, and writable
    check_not_in_use(output_dir)              # preflight: no live run holds the folder
    with RunLock(output_dir):                 # train.py, the writing process only
        ... train ...
    except OSError as err: raise write_error(err, {"output_dir": out, ...})

    check_not_foreign(output_dir, "output_dir", inputs)  # preflight: no model, data, others' steps

Decisions:
- Nothing of others is written over: `output_dir` may not be the folder of a model, tokenizer
  or data file the run reads, nor hold model weights, a model's config.json, a tokenizer, data
  files or checkpoint steps (a folder a run would overwrite, or another run's checkpoint.dir).
- Writability is judged without writing (preflight writes nothing): the folder, or its nearest
  existing parent when it does not exist yet, must be a directory on a file system mounted
  read-write (`statvfs`; root passes `os.access` even there) that `os.access` lets us write.
- The lock is `<folder>/.run.lock` (output_dir, checkpoint.dir, evaluate's --out), holding
  the owner's pid, host and start time, written whole and linked into place (atomic, refused
  when it exists). A lock whose pid is dead on this host, or now belongs to a process started
  later (pid reuse), is stale (a killed run): it is taken over with a warning (renamed away
  first, so two runs cannot both take it). A lock from
  another host cannot be judged and refuses the run; the message names the file to remove.
- Releasing removes the lock, and the folders the lock itself created when they stayed empty
  (a run refused after preflight leaves nothing behind).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
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
    for link in (path, *path.parents):
        if link.is_symlink() and not link.exists():
            raise RunDirError(f"{field} {path}: {link} is a symbolic link to {os.readlink(link)}, "
                              f"which does not exist; create that folder, or point {field} "
                              "elsewhere")
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


# ----------------------------------------------------------------------------- nothing of others

# What a run (and `evaluate --out`) writes itself: found in a folder, they are a run's own.
# metrics.py keeps every earlier row it moves: a fresh start over a log renames it to
# metrics.1.jsonl, .2 ...; a resume sets the rows after its step aside in
# metrics.after_step_N.jsonl (.2 ... when taken). Each is the run's own, or the second
# resume of a run would refuse its own folder.
RUN_JSONL = frozenset({"metrics.jsonl", "samples.jsonl", "config_changes.jsonl", "per_problem.jsonl"})
_RUN_LOG = re.compile(r"(metrics|samples)(\.\d+|\.after_step_\d+(\.\d+)?)?\.jsonl")


def is_run_file(name: str) -> bool:
    """A file name the trainer or `evaluate --out` writes itself (above)."""
    return name in RUN_JSONL or _RUN_LOG.fullmatch(name) is not None


DATA_SUFFIXES = (".jsonl", ".parquet", ".arrow", ".csv", ".tsv")


def _is_run_config(path: Path) -> bool:
    """A run's config.json (what the trainer writes: output_dir and algorithm among its keys);
    an unreadable one counts as a run's (resume_config reports it)."""
    try:
        tree = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    return isinstance(tree, dict) and "output_dir" in tree and "algorithm" in tree


def foreign_contents(folder: Path, checkpoint_folder: bool = False) -> str | None:
    """What in `folder` belongs to something other than a run, described for a message: a
    model (weights, its config.json, a tokenizer), a dataset, or, unless `checkpoint_folder`,
    checkpoint steps (another run's checkpoint.dir); None when nothing does."""
    if not folder.is_dir():
        return None
    names = sorted(p.name for p in folder.iterdir())
    weights = [n for n in names if n.endswith((".safetensors", ".bin", ".gguf"))]
    if weights:
        return f"a model's weights ({weights[0]})"
    if "config.json" in names and not _is_run_config(folder / "config.json"):
        return "a model's config.json"
    if "tokenizer.json" in names:
        return "a tokenizer (tokenizer.json)"
    data = [n for n in names if n.endswith(DATA_SUFFIXES) and not is_run_file(n)
            or n in ("dataset_info.json", "dataset_dict.json")]
    if data:
        return f"a dataset ({data[0]})"
    steps = [n for n in names if n.isdigit() and (folder / n).is_dir()]
    if steps and not checkpoint_folder:
        return f"checkpoint steps ({', '.join(steps[:3])}: another run's checkpoint.dir)"
    return None


def check_not_foreign(folder: str | Path, field: str, inputs: dict[str, Path],
                      checkpoint_folder: bool = False) -> None:
    """RunDirError when a run would write into `folder` over what is not its own: the folder of
    one of its `inputs` (field -> folder: models, tokenizers, data), or a folder holding a
    model, a dataset or checkpoint steps (`foreign_contents`)."""
    folder = Path(folder).absolute()
    real = folder.resolve()
    for name, path in inputs.items():
        if Path(path).resolve() == real:
            raise RunDirError(f"{field} {folder} is the folder of {name}; a run writes config.json, "
                              f"metrics and checkpoints there, over its files: choose another {field}")
    what = foreign_contents(folder, checkpoint_folder)
    if what:
        raise RunDirError(f"{field} {folder} holds {what}, not a run's files; a run writes "
                          f"config.json, metrics and checkpoints there, over them: choose a new "
                          f"or empty {field}")


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


def process_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (another user's counts)."""
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
    if not process_alive(pid):
        return True
    ticks = owner.get("start_ticks")
    return ticks is not None and _start_ticks(pid) not in (None, ticks)


def _in_use(folder: Path, owner: dict, field: str) -> RunDirError:
    lock = folder / LOCK_NAME
    who = (f"pid {owner.get('pid')} on host {owner.get('host')} since {owner.get('started')}"
           if owner else "an unknown process")
    return RunDirError(f"{field} {folder} is in use by another run ({who}); wait for it to "
                       f"finish or choose another {field} (if that run is gone, remove {lock})")


def check_not_in_use(folder: str | Path, field: str = "output_dir") -> None:
    """RunDirError when a live process holds `folder` (a stale lock passes: RunLock takes it)."""
    folder = Path(folder).absolute()
    owner = _read_lock(folder / LOCK_NAME)
    if owner is not None and not _is_stale(owner):
        raise _in_use(folder, owner, field)


class RunLock:
    """`with RunLock(folder, field):` holds `<folder>/.run.lock` for the run (module doc);
    `field` names the folder in messages (output_dir, checkpoint.dir, --out)."""

    def __init__(self, folder: str | Path, field: str = "output_dir"):
        self.folder = Path(folder).absolute()
        self.field = field
        self.path = self.folder / LOCK_NAME
        self._created: list[Path] = []

    def acquire(self) -> "RunLock":
        missing = []
        parent = self.folder
        while not parent.exists():
            missing.append(parent)
            parent = parent.parent
        self.folder.mkdir(parents=True, exist_ok=True)
        self._created = missing   # deepest first: the order to remove them in
        owner = {"pid": os.getpid(), "host": socket.gethostname(),
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                 "start_ticks": _start_ticks(os.getpid())}
        # written whole beside the lock, then linked into place (atomic, and refused when the
        # lock exists): a signal at any moment leaves no half-written lock
        draft = self.path.with_name(f"{LOCK_NAME}.{os.getpid()}")
        draft.write_text(json.dumps(owner), encoding="utf-8")
        try:
            for _ in range(2):        # a second try after taking over a stale lock
                try:
                    os.link(draft, self.path)
                except FileExistsError:
                    held = _read_lock(self.path)
                    if held is not None and not _is_stale(held):
                        break
                    if held is not None:   # else it was released meanwhile: try again
                        self._take_over(held)
                    continue
                return self
        finally:
            draft.unlink(missing_ok=True)
        self._remove_created()
        raise _in_use(self.folder, _read_lock(self.path) or {}, self.field)

    def _take_over(self, held: dict) -> None:
        aside = self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}")
        try:
            os.rename(self.path, aside)   # atomic: of two runs taking over, one wins
        except FileNotFoundError:
            return
        aside.unlink(missing_ok=True)
        warnings.warn(f"{self.field} {self.folder}: taking over the lock of pid {held.get('pid')} "
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


# ----------------------------------------------------------------------------- whole folders

@contextlib.contextmanager
def replaced_folder(out: str | Path):
    """`with replaced_folder(out) as staging:` what the block writes into `staging` (a hidden
    sibling) replaces the folder `out` as a whole when the block ends, or never: an error or a
    kill leaves `out` as it was, never half-written (an exported model, an adapter). Only for
    folders that one process writes (under its run lock): it clears its own leftovers."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    old = out.parent / f".{out.name}.old"
    for stale in out.parent.glob(f".{out.name}.tmp-*"):   # a killed write's, never in place
        shutil.rmtree(stale, ignore_errors=True)
    if old.is_dir() and not out.exists():   # killed between the two renames below: put it back
        os.replace(old, out)
    shutil.rmtree(old, ignore_errors=True)
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}"
    staging.mkdir()
    try:
        yield staging
        if out.exists():
            os.replace(out, old)
        os.replace(staging, out)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
