"""The environment: a cache that cannot be written is one line naming CTOPD_JAX_CACHE, whose
suggested value then works; `demo --algorithm` leaves nothing in the temporary folder; the
README's table names every file a run, an evaluation and the cache hold."""
import re
from argparse import Namespace
from pathlib import Path

import pytest

from ctopd_jax import train

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


@pytest.fixture
def started(monkeypatch):
    """train._train replaced: a run that reaches it has passed every check."""
    monkeypatch.setattr(train, "_train", lambda config, pre, args, writer: 0)


@pytest.fixture(params=["under_a_file", "read_only_mount"])
def unwritable_cache(request, tmp_path):
    """A cache folder that refuses writes: below a file (any user), or on a read-only tmpfs
    (root may write anywhere else; skipped where mounting is not allowed)."""
    if request.param == "under_a_file":
        (tmp_path / "a_file").write_text("")
        return tmp_path / "a_file" / "cache"
    return request.getfixturevalue("read_only_dir")   # conftest: skipped without mounting


def test_an_unwritable_cache_is_one_line_with_a_way_out_that_works(tmp_path, monkeypatch,
                                                                   capsys, started,
                                                                   unwritable_cache):
    monkeypatch.setenv("CTOPD_JAX_CACHE", str(unwritable_cache))
    argv = ["--config", TINY, "--set", f"output_dir={tmp_path / 'run'}"]   # data.path demo:train
    assert train.main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert f"cache {unwritable_cache}/demo" in line and "set CTOPD_JAX_CACHE to a folder" in line
    suggested = re.search(r"e\.g\. CTOPD_JAX_CACHE=(\S+)", line).group(1)
    monkeypatch.setenv("CTOPD_JAX_CACHE", suggested)
    assert train.main(argv) == 0, capsys.readouterr().err
    assert (Path(suggested) / "demo" / "train.jsonl").is_file()


def test_demo_algorithm_config_leaves_nothing_in_the_temporary_folder(tmp_path, monkeypatch):
    import tempfile

    from ctopd_jax.demo.__main__ import DEFAULT_CONFIG, _config
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    args = Namespace(algorithm="opd", config=DEFAULT_CONFIG, overrides=[], steps=3)
    config = _config(args, tmp_path / "run")
    assert config.algorithm.name == "opd" and config.steps == 3
    assert not list(temp.iterdir())
    with pytest.raises(Exception, match="optimizer.lr"):   # a refused config too
        _config(Namespace(algorithm="opd", config=DEFAULT_CONFIG,
                          overrides=["optimizer.lr=fast"], steps=None), tmp_path / "run")
    assert not list(temp.iterdir()) and not (tmp_path / "run").exists()


def test_the_readme_table_names_every_file_written():
    from ctopd_jax.common.cache import CACHE_VARIABLE
    from ctopd_jax.loop.mean_at_k import REPORT_FILES, REPORT_INCOMPLETE
    from ctopd_jax.common.metrics import METRICS_FILE, SAMPLES_FILE, WANDB_ID_FILE
    from ctopd_jax.preflight.resume_config import CHANGES_FILE
    from ctopd_jax.common.run_dir import LOCK_NAME

    text = (ROOT / "README.md").read_text()
    table = text[text.index("### Where the project writes"):text.index("## Layout")]
    for name in (METRICS_FILE, SAMPLES_FILE, WANDB_ID_FILE, CHANGES_FILE, LOCK_NAME,
                 *REPORT_FILES, REPORT_INCOMPLETE, "config.json", "hf_student/",
                 "metrics.after_step_N.jsonl", ".hf_student.tmp-", "plots/", "adapter/",
                 "tensorboard/", "eval/step_N/", "demo_summary.json", CACHE_VARIABLE,
                 "ctopd_vllm_", "vllm_server_"):
        assert name in table, name


def test_demo_out_never_lands_on_a_file_or_a_dangling_link(tmp_path):
    from ctopd_jax.demo.__main__ import fresh_output_dir
    (tmp_path / "a_file").write_text("keep me")
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    assert fresh_output_dir(tmp_path / "a_file") == tmp_path / "a_file-2"
    assert fresh_output_dir(tmp_path / "link") == tmp_path / "link-2"
    assert (tmp_path / "a_file").read_text() == "keep me"
