"""docs/config.md is what `python -m ctopd_jax.config_doc` writes, and it names every key.

The expected key list here is read with `dataclasses.fields` on the config classes and the
objective registry, not through the generator's own table code."""
import dataclasses
import re
from pathlib import Path

from ctopd_jax import algorithms, config
from ctopd_jax.config_doc import UNDOCUMENTED, field_doc, main, render, yaml_text

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "config.md"
FIX = "run `python -m ctopd_jax.config_doc docs/config.md` and commit the result"


def test_docs_config_md_is_what_the_generator_writes():
    assert PAGE.read_text(encoding="utf-8") == render(), f"docs/config.md is stale: {FIX}"


def _keys(cls, prefix):
    for f in dataclasses.fields(cls):
        value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(value):
            yield from _keys(type(value), f"{prefix}{f.name}.")
        elif f.name == "teachers":
            yield from _keys(config.NamedTeacherSection, "teachers[].")
        else:
            yield f"{prefix}{f.name}", value


def test_every_key_of_every_section_and_objective_is_on_the_page_with_its_default():
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
            for line in render().splitlines() if line.startswith("| `")]
    documented = {key.strip("`"): default.strip("`") for key, _, default, _ in rows}
    expected = dict(_keys(config.TrainConfig, ""))
    for objective in algorithms.registry().values():
        expected.update(_keys(objective.settings_class, "algorithm."))
    missing = sorted(set(expected) - set(documented))
    assert not missing, f"keys missing from docs/config.md: {missing}"
    assert "algorithm.span_lambda" in documented and "optimizer.lr" in documented
    assert documented["optimizer.lr"] == "1e-06" and documented["rollout.engine"] == "jax"


def test_every_key_has_a_meaning():
    assert UNDOCUMENTED not in render(), (
        "a config field has no comment: write its meaning beside it (`field: int = 0  # ...`), "
        f"then {FIX}")


def test_a_field_doc_is_its_line_comment_else_the_comment_block_above():
    @dataclasses.dataclass(frozen=True)
    class Probe:
        # the block above
        # spans two lines
        above: int = 1
        beside: str = ""    # the comment beside

        bare: bool = False
    assert field_doc(Probe, "above") == "the block above spans two lines"
    assert field_doc(Probe, "beside") == "the comment beside"
    assert field_doc(Probe, "bare") == ""
    assert [yaml_text(v) for v in (None, True, "", (0.9, 0.98), 1e-6)] == \
        ["null", "true", '""', "[0.9, 0.98]", "1e-06"]


def test_the_command_writes_the_page_and_refuses_a_folder_it_cannot_write(tmp_path, capsys):
    out = tmp_path / "config.md"
    assert main([str(out)]) == 0
    assert out.read_text(encoding="utf-8") == PAGE.read_text(encoding="utf-8")
    assert main([str(tmp_path / "no" / "x.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m ctopd_jax.config_doc: error:") and err.count("\n") == 1, err
    assert "x.md" in err
