"""Resume knows its own run: the run is the one whose checkpoints output_dir leads to, not the
spelling of the path (`runs/x/`, `./runs/x`, absolute) nor where the folder lives (a moved run
resumes, bit-exact); a resume asked for fewer steps than the checkpoint holds is refused in one
line."""
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from ctopd_jax import train
from ctopd_jax.common.metrics import read_metrics, run_values
from ctopd_jax.common.run_guard import Stopped
from ctopd_jax.config import load_config
from ctopd_jax.loop.trainer import Trainer
from ctopd_jax.preflight import preflight

from conftest import tiny_tree

SPELLINGS = ["runs/x", "runs/x/", "./runs/x", "./runs/../runs/x", "{abs}"]


def saved_run(tmp: Path, spelling: str) -> Path:
    """A run folder as the trainer leaves it, its config saved with output_dir `spelling`
    (checkpoint step 2 with a readable meta; preflight reads no arrays)."""
    run = tmp / "runs" / "x"
    tree = tiny_tree(spelling)
    (run / "checkpoints" / "2" / "meta").mkdir(parents=True)
    (run / "checkpoints" / "2" / "meta" / "metadata").write_text(json.dumps({"step": 2}))
    cfg = tmp / "run.yaml"
    cfg.write_text(yaml.safe_dump(tree))
    (run / "config.json").write_text(load_config(cfg).to_json())
    return cfg


@pytest.mark.parametrize("saved", SPELLINGS)
def test_every_spelling_of_the_folder_resumes_the_same_run(tmp_path, monkeypatch, saved):
    monkeypatch.chdir(tmp_path)
    absolute = str(tmp_path / "runs" / "x")
    cfg = saved_run(tmp_path, saved.format(abs=absolute))
    for spelling in SPELLINGS:
        config = load_config(cfg, [f"output_dir={spelling.format(abs=absolute)}"])
        with preflight(config, resume=True) as pre:
            assert pre.checkpoint_steps == [2]
            assert all(c.field == "output_dir" for c in pre.config_changes), pre.config_changes


def test_fewer_steps_than_the_checkpoint_holds_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.chdir(tmp_path)
    cfg = saved_run(tmp_path, "runs/x")
    code = train.main(["--config", str(cfg), "--resume", "--allow-config-change",
                       "--set", "steps=1"])
    _, err = capsys.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "steps: 1, but the checkpoint in" in err and "at step 2 already" in err
    assert "set steps to 2 or more" in err
    assert not (tmp_path / "runs" / "x" / "config_changes.jsonl").exists()


class StopAt:
    """What a SIGTERM at step `step` does to the loop (run_guard.SignalGuard's interface)."""

    def __init__(self, step):
        self.step, self.seen, self.signum = step, 0, 15

    def requested_everywhere(self):
        self.seen += 1
        return self.seen == self.step


@pytest.mark.slow   # a reference run, a stopped run and its resume (~1 min on 2 cores)
def test_a_moved_run_folder_resumes_bit_exact(tmp_path):
    tree = tiny_tree(tmp_path / "reference", **{"checkpoint.every": 0})
    (tmp_path / "reference.yaml").write_text(yaml.safe_dump(tree))
    reference = Trainer(load_config(tmp_path / "reference.yaml"))
    reference.train()

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_tree(tmp_path / "first" / "run", **{"checkpoint.every": 0})))
    with pytest.raises(Stopped):
        Trainer(load_config(cfg)).train(stop=StopAt(2))
    moved = tmp_path / "elsewhere" / "renamed"
    moved.parent.mkdir()
    shutil.move(tmp_path / "first" / "run", moved)

    assert train.main(["--config", str(cfg), "--set", f"output_dir={moved}", "--resume"]) == 0
    resumed = Trainer(load_config(cfg, [f"output_dir={moved}"]))
    from ctopd_jax.loop.checkpoint import Checkpointer
    ck = Checkpointer(moved / "checkpoints")
    restored = ck.restore_latest(resumed._state())
    ck.close()
    assert restored.step == 4
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, reference._state())),
                    jax.tree.leaves(jax.tree.map(np.asarray, restored.state)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert [r["step"] for r in read_metrics(moved)] == [1, 2, 3, 4]
    same = lambda rows: [run_values(r) for r in rows]
    assert same(read_metrics(moved)) == same(read_metrics(tmp_path / "reference"))
