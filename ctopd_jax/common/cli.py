"""One error path for every command line (train, evaluate, inspect_pair, plot, plan, demo).

A command's inner `main(argv) -> int` raises; `run(inner, argv, prog)` turns a known user error
(a bad config value, data row, tokenizer, mesh, checkpoint, missing file ...) into ONE line on
stderr, `prog: error: <message>`, and exit status 2, with no traceback. `--debug` (or
CTOPD_DEBUG=1) re-raises it so the traceback shows. Anything else is a bug and keeps its
traceback. A SIGTERM / SIGINT while the command runs is one line too (`run_guard`: the locks
released, nothing half-written). Exit statuses: 0 done, 2 bad input (or a write the file system
refused: no space, read-only, permission), 3 training diverged, 130 / 143 stopped by SIGINT /
SIGTERM (128 + the signal number, what shells report for a signal).

The environment is part of the input: a bad host device count in XLA_FLAGS is refused before
JAX starts, and a backend that cannot start (JAX_PLATFORMS naming a platform the machine lacks)
is one line naming JAX_PLATFORMS and the fix, wherever a command first touches JAX.

Error classes are matched by (module, name) and only when their module is already imported, so
this module imports nothing heavy and a command never loads jax just to report a typo.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, NoReturn, Sequence

from ctopd_jax.common.run_dir import disk_errno
from ctopd_jax.common.run_guard import Interrupted, Stopped, TrainingDiverged, raising, received

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class UserError(ValueError):
    """A bad input found by a command itself; its message is the one line shown."""


# Exceptions whose message already names the field or file and the fix.
USER_ERRORS: tuple[tuple[str, str], ...] = (
    ("ctopd_jax.common.cli", "UserError"),
    ("ctopd_jax.config", "ConfigError"),
    ("ctopd_jax.preflight", "PreflightError"),
    ("ctopd_jax.preflight.resume_config", "ConfigChangeError"),
    ("ctopd_jax.common.records", "RecordError"),
    ("ctopd_jax.mesh.device_mesh", "MeshError"),
    ("ctopd_jax.tokenization.side", "TokenizerLoadError"),
    ("ctopd_jax.tokenization.overlap", "NoOverlapError"),
    ("ctopd_jax.loop.checkpoint", "CheckpointError"),
    ("ctopd_jax.common.run_dir", "RunDirError"),
    ("ctopd_jax.models.weights", "CheckpointError"),
    ("ctopd_jax.models.config", "ModelConfigError"),
    ("ctopd_jax.loop.build", "TrainerSetupError"),
    ("ctopd_jax.loop.trainer", "TrainerSetupError"),
    ("ctopd_jax.common.sources", "SourceError"),
    ("ctopd_jax.tokenization.chat", "ChatTemplateError"),
    ("ctopd_jax.setup_assets", "AssetSetupError"),
    ("ctopd_jax.common.cache", "CacheError"),
    ("ctopd_jax.models.gguf_read", "GGUFError"),
    ("ctopd_jax.models.packaged", "FetchError"),
    ("ctopd_jax.rollout.base", "RolloutConfigError"),
    ("ctopd_jax.rollout.vllm_engine", "VllmNotInstalledError"),
    ("ctopd_jax.common.metrics", "MetricsError"),
    ("ctopd_jax.align", "ByteMismatchError"),
    ("ctopd_jax.teacher_service.client", "TeacherServiceError"),   # a served teacher failed mid-run
)
# Plain OS errors about a path the user gave (the message holds the path), and any OSError of
# a write the file system refused (run_dir.DISK_ERRNOS).
OS_USER_ERRORS = (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)


def is_user_error(err: BaseException) -> bool:
    if isinstance(err, OS_USER_ERRORS):
        return True
    if disk_errno(err) is not None:
        return True
    for module, name in USER_ERRORS:
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(err, cls):
            return True
    return False


def one_line(err: BaseException | str) -> str:
    """The message on one line (whitespace runs, newlines included, become one space)."""
    text = str(err) if not isinstance(err, OSError) or not err.filename else (
        f"{err.filename}: {err.strerror or err}" if err.strerror else str(err))
    return " ".join(text.split()) or type(err).__name__


def debug_requested(argv: Sequence[str]) -> bool:
    return "--debug" in argv or os.environ.get("CTOPD_DEBUG", "") not in ("", "0")


class Parser(argparse.ArgumentParser):
    """argparse with a one-line usage error (`prog: error: ...; see --help`, exit 2) and the
    shared `--debug` flag; descriptions keep their line breaks."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)
        self.add_argument("--debug", action="store_true",
                          help="show the full traceback of an error instead of one line")

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {one_line(message)}; see {self.prog} --help", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


# ----------------------------------------------------------------------------- flag ranges
# argparse `type=` functions: a value out of range is a usage error naming the flag
# (`prog: error: argument --mfu: 0 must be in (0, 1]`), raised before any work starts.

def _number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def at_least(minimum: int) -> Callable[[str], int]:
    """An integer >= minimum (counts, sizes)."""
    def parse(text: str) -> int:
        value = _number(text, int)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be >= {minimum}")
        return value
    return parse


def seed(text: str) -> int:
    """A seed: an integer in [0, 2**32), what numpy and the data loader accept."""
    value = _number(text, int)
    if not 0 <= value < 2 ** 32:
        raise argparse.ArgumentTypeError(f"{value} must be in [0, 2**32)")
    return value


def positive(text: str) -> float:
    """A finite number > 0 (seconds, rates)."""
    value = _number(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be > 0")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1] (utilisations, memory fractions)."""
    value = _number(text, float)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value:g} must be in (0, 1]")
    return value


# ----------------------------------------------------------------------------- the JAX platform
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def check_xla_flags(env: dict | None = None) -> None:
    """UserError for a host device count in XLA_FLAGS that XLA would abort on (not a whole
    number) or fail on (below 1); read from the environment only, before JAX starts."""
    flags = (os.environ if env is None else env).get("XLA_FLAGS", "")
    for flag in flags.split():
        name, _, value = flag.partition("=")
        if name == DEVICE_COUNT_FLAG and not (value.isdigit() and int(value) >= 1):
            raise UserError(f"XLA_FLAGS: {flag} is not a whole number of devices >= 1; set "
                            f"e.g. XLA_FLAGS={DEVICE_COUNT_FLAG}=8, or remove the flag")


def backend_failure(err: BaseException) -> str | None:
    """One line for a JAX backend that could not start (JAX_PLATFORMS naming a platform this
    machine lacks, a broken plugin), else None. JAX says it as a RuntimeError, or as an
    AssertionError inside xla_bridge when the named platform's plugin is not installed."""
    if "jax" not in sys.modules:
        return None
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = tb.tb_frame.f_code.co_filename if tb is not None else ""
    if not ((isinstance(err, RuntimeError) and "Unable to initialize backend" in str(err))
            or (isinstance(err, AssertionError) and where.endswith("xla_bridge.py"))):
        return None
    platforms = os.environ.get("JAX_PLATFORMS", "")
    reason = str(err).split(" (")[0] if isinstance(err, RuntimeError) else \
        "its plugin is not installed, or it found no device"
    return (f"JAX_PLATFORMS={platforms!r}: the JAX backend cannot start ({reason}); set "
            "JAX_PLATFORMS to a platform this machine has, e.g. JAX_PLATFORMS=cpu, or unset it")


def fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    return EXIT_USAGE


def run(inner: Callable[[list[str]], int | None], argv: Sequence[str] | None, prog: str) -> int:
    """Call `inner(argv)` and map what it raises to an exit status (see the module doc)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = debug_requested(argv)
    try:
        with raising():   # a signal raises Interrupted here: the `with` blocks release, one line
            check_xla_flags()
            code = inner(argv)
        if received() is not None:    # an Interrupted that a library swallowed
            raise Interrupted(received())
    except (Interrupted, Stopped) as err:   # a signal, in the loop (Stopped) or outside it
        print(f"{prog}: {one_line(err)}", file=sys.stderr, flush=True)
        return err.exit_code
    except TrainingDiverged as err:   # the divergence guard: where it stopped, what to change
        print(f"{prog}: training stopped: {one_line(err)}", file=sys.stderr, flush=True)
        return err.exit_code
    except SystemExit as exc:  # argparse (--help, usage errors) or an explicit exit
        if isinstance(exc.code, str):
            if debug:
                raise
            return fail(prog, exc.code)
        return EXIT_OK if exc.code is None else int(exc.code)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_SIGINT
    except Exception as err:
        backend = backend_failure(err)
        if debug or not (backend or is_user_error(err)):
            raise
        return fail(prog, backend or one_line(err))
    return EXIT_OK if code is None else int(code)
