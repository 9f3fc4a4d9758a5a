"""checkpoint.save: false (the GPU check's end-to-end run) trains without writing any checkpoint,
and every logged row carries the iteration's compile seconds."""
from ctopd_jax.common.metrics import read_metrics
from ctopd_jax.config import load_config
from ctopd_jax.loop.checkpoint import Checkpointer
from ctopd_jax.loop.trainer import Trainer


def test_no_checkpoint_is_written_and_rows_report_compile_seconds(write_config):
    cfg, run_dir = write_config("throwaway", steps=2, checkpoint__every=1, checkpoint__save=False)
    Trainer(load_config(cfg)).train()
    ck = Checkpointer(run_dir / "checkpoints")
    assert ck.steps() == []
    ck.close()
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    # the first iteration compiles the sampler, the teacher and the student step; the second
    # reuses them (the same shapes), so it compiles less
    assert rows[0]["time_compile"] > 0.0
    assert rows[1]["time_compile"] < rows[0]["time_compile"]
    assert rows[0]["time_compile"] <= rows[0]["time_total"]
