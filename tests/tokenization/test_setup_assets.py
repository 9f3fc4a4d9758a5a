"""The real-tokenizer setup: idempotent, and a clear error without npm."""
import pytest

from ctopd_jax import setup_assets as setup


def test_idempotent_when_ready(qwen, llama, capsys):
    setup.setup_assets()
    out = capsys.readouterr().out
    assert "qwen2.5: ready" in out and "llama3: ready" in out
    assert (setup.cache_root() / ".ready").is_file()


def test_missing_npm_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(setup.shutil, "which", lambda name: None)
    with pytest.raises(setup.AssetSetupError, match="npm"):
        setup.build_llama3(tmp_path / "llama3")
