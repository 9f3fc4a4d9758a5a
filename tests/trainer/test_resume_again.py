"""A run resumed once can be resumed again, and again: each resume that falls back past a lost
checkpoint sets the later metrics rows aside (metrics.after_step_N.jsonl), and the output-dir
guard must take those files for the run's own, not for a dataset (issue 43)."""
import json
import shutil

import pytest
import yaml

from ctopd_jax import train
from ctopd_jax.common.metrics import read_metrics

from conftest import tiny_tree


def run(capsys, cfg, *extra):
    code = train.main(["--config", str(cfg), *extra])
    err = capsys.readouterr().err
    assert code == 0 and "error:" not in err, (code, err[-3000:])


@pytest.mark.slow   # four tiny runs in one process (~1 min on 2 cores)
def test_the_same_run_resumed_three_times(tmp_path, capsys):
    out = tmp_path / "run"
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump(tiny_tree(out, steps=2, **{"checkpoint.every": 1})))
    run(capsys, cfg)
    for last in (2, 3, 4):
        shutil.rmtree(out / "checkpoints" / str(last))   # the newest step is lost: fall back
        run(capsys, cfg, "--resume", "--allow-config-change", "--set", f"steps={last + 1}")
        assert (out / f"metrics.after_step_{last - 1}.jsonl").is_file()
    # every resume kept the rows up to its step and wrote the rest once: 1..5, no repeat
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4, 5]
    aside = [json.loads(line)["step"] for p in sorted(out.glob("metrics.after_step_*.jsonl"))
             for line in p.read_text().splitlines()]
    assert sorted(aside) == [2, 3, 4], aside
