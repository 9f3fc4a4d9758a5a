"""`python -m ctopd_jax.train` rejects bad configs with one message and exit status 2, before
any model is loaded."""
import pytest

from ctopd_jax.train import main


@pytest.mark.parametrize("args,message", [
    (["--config", "no/such.yaml"], "file not found"),
    (["--config", "configs/tiny_cpu.yaml", "--set", "optimizer.lr=-1"], "optimizer.lr"),
    (["--config", "configs/tiny_cpu.yaml", "--set", "algorithm.nam=strict"], "unknown config key"),
    (["--config", "configs/tiny_cpu.yaml", "--mesh", "data=3"], "devices"),
])
def test_bad_config_exits_2_with_message(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error:") and message in err
