"""GGUF in (`python -m ctopd_jax.from_gguf`): tiny files written with gguf.GGUFWriter convert
to folders whose logits match transformers' own GGUF load of the same file (the independent
reference: its reader and its undoing of llama.cpp's q/k order); bad files are one line, exit
status 2, and nothing at the output folder."""
import hashlib
import json
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from gguf_fixtures import SPECIALS, TEMPLATE, tiny_config, write_gguf
from hf_fixtures import jax_logits
from ctopd_jax import from_gguf as gguf_cli
from ctopd_jax.models import weights
from ctopd_jax.tokenization.side import load_tokenizer_side


def _convert(argv, capsys):
    code = gguf_cli.run(gguf_cli.main, argv, gguf_cli.PROG)
    captured = capsys.readouterr()
    return code, captured.err.strip()


def _one_line(code, err):
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_tiny_gguf_converts_to_logits_transformers_reads_from_the_same_file(family, tmp_path,
                                                                            capsys):
    src = tmp_path / f"{family}.gguf"
    original = write_gguf(src, family)
    code, err = _convert([str(src), str(tmp_path / "hf")], capsys)
    assert code == 0, err
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=src.name,
                                                     dtype=torch.float32)
    model, cfg = weights.load_hf_checkpoint(tmp_path / "hf")
    assert cfg == tiny_config(family).replace(max_position_embeddings=cfg.max_position_embeddings)
    ids = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        want = reference(torch.tensor(ids)).logits.numpy()
        written = original(torch.tensor(ids)).logits.numpy()
    assert np.abs(want).max() > 0.5, "reference logits too small for a meaningful comparison"
    assert np.abs(want - written).max() <= 1e-4   # the reference read back what was written
    err = np.abs(jax_logits(model, ids) - want).max()
    assert err <= 1e-4, f"{family}: max abs logits error {err}"


def test_the_tokenizer_and_chat_template_come_from_the_metadata(tmp_path, capsys):
    src = tmp_path / "qwen2.gguf"
    write_gguf(src, "qwen2")
    assert _convert([str(src), str(tmp_path / "hf")], capsys)[0] == 0
    side = load_tokenizer_side(tmp_path / "hf")
    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=src.name)
    for text in ("the theme", " the 12 + 345 = 357\n\n  x", "<|im_start|>user\nhé<|im_end|>"):
        assert side.encode(text) == reference(text, add_special_tokens=False)["input_ids"], text
    assert side.eos_id == side.encode("<|im_end|>")[0]
    assert side.chat_template == TEMPLATE
    assert side.render_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    added = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())["added_tokens"]
    assert {t["content"] for t in added if t["special"]} == set(SPECIALS)


def test_smollm_split_puts_each_digit_alone(tmp_path, capsys):
    src = tmp_path / "llama.gguf"
    write_gguf(src, "llama")   # pre "smollm"
    assert _convert([str(src), str(tmp_path / "hf")], capsys)[0] == 0
    side = load_tokenizer_side(tmp_path / "hf")
    assert [side.decode([i]) for i in side.encode("x 123")] == ["x", " ", "1", "2", "3"]


def test_another_architecture_is_one_line_and_nothing_written(tmp_path, capsys):
    src = tmp_path / "gemma.gguf"
    write_gguf(src, "llama", arch="gemma")
    err = _one_line(*_convert([str(src), str(tmp_path / "hf")], capsys))
    assert "general.architecture is 'gemma'" in err and "llama and qwen2" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma.gguf"]


def test_a_truncated_file_is_one_line_and_nothing_written(tmp_path, capsys):
    src = tmp_path / "cut.gguf"
    write_gguf(src, "qwen2")
    data = src.read_bytes()
    src.write_bytes(data[: len(data) - 1000])
    err = _one_line(*_convert([str(src), str(tmp_path / "hf")], capsys))
    assert "truncated" in err and str(src) in err and "again" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf"]


def test_a_cut_header_and_a_file_of_another_kind_are_one_line(tmp_path, capsys):
    src = tmp_path / "header.gguf"
    write_gguf(src, "llama")
    src.write_bytes(src.read_bytes()[:200])   # inside the metadata
    err = _one_line(*_convert([str(src), str(tmp_path / "a")], capsys))
    assert "truncated or damaged" in err
    other = tmp_path / "weights.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    err = _one_line(*_convert([str(other), str(tmp_path / "b")], capsys))
    assert "not a GGUF file" in err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_wrong_checksum_is_one_line_and_the_right_one_converts(tmp_path, capsys):
    src = tmp_path / "m.gguf"
    write_gguf(src, "qwen2")
    err = _one_line(*_convert([str(src), str(tmp_path / "hf"), "--sha256", "0" * 64], capsys))
    assert "sha256 is" in err and "expected " + "0" * 64 in err
    assert not (tmp_path / "hf").exists()
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    assert _convert([str(src), str(tmp_path / "hf"), "--sha256", digest], capsys)[0] == 0
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_an_existing_output_folder_is_refused(tmp_path, capsys):
    src = tmp_path / "m.gguf"
    write_gguf(src, "qwen2")
    (tmp_path / "hf").mkdir()
    err = _one_line(*_convert([str(src), str(tmp_path / "hf")], capsys))
    assert "already exists" in err
    assert list((tmp_path / "hf").iterdir()) == []


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_conversion_killed_midway_is_never_taken_for_whole_and_reruns_the_same(tmp_path, capsys,
                                                                                which):
    """SIGKILL (common/kill_points.py) while the weights are dequantized: no folder at the
    output path, the rerun writes the same bytes as a conversion never killed, and removes
    what the killed one left."""
    src = tmp_path / "m.gguf"
    write_gguf(src, "qwen2")
    passage = 1 if which == "first" else len(gguf.GGUFReader(str(src)).tensors)
    assert _convert([str(src), str(tmp_path / "whole")], capsys)[0] == 0
    out = tmp_path / "hf"
    env = {**os.environ, "CTOPD_JAX_KILL_AT": f"gguf_convert:{passage}", "JAX_PLATFORMS": "cpu"}
    killed = subprocess.run([sys.executable, "-m", "ctopd_jax.from_gguf", str(src), str(out)],
                            env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert f"kill point gguf_convert:{passage}" in killed.stderr
    assert not out.exists()
    assert len(list(tmp_path.glob(".hf.partial-*"))) == 1   # what the kill left behind
    assert _convert([str(src), str(out)], capsys)[0] == 0
    assert list(tmp_path.glob(".hf.partial-*")) == []
    files = sorted(p.name for p in (tmp_path / "whole").iterdir())
    assert sorted(p.name for p in out.iterdir()) == files
    for name in files:
        assert (out / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
