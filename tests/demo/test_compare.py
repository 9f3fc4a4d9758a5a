"""`demo --compare` and `--algorithm`: the demo recipes, the per-seed rows and their table."""
import json

import pytest

from ctopd_jax.demo import compare


def test_recipe_applies_on_the_objectives_own_pair_only(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes.yaml"
    recipes.write_text("opd:\n  optimizer.lr: 2.0e-4\n  algorithm.opd_clip: ppo\n")
    monkeypatch.setattr(compare, "RECIPES", recipes)
    assert compare.recipe_overrides("opd", "char") == ["optimizer.lr=0.0002", "algorithm.opd_clip=ppo"]
    assert compare.recipe_overrides("opd", "char_lora") == []     # the LoRA row keeps its config
    assert compare.recipe_overrides("opd", "tools") == []         # the time reference too
    assert compare.recipe_overrides("gkd", "char") == []          # no entry: the pair's config
    assert compare.recipe_overrides("opd", "char", "strict") == ["optimizer.lr=0.001"]  # tiny_cpu.yaml
    with pytest.raises(ValueError, match="recipe must be"):
        compare.recipe_overrides("opd", "char", "best")


def test_shipped_recipes_name_registered_objectives_and_valid_settings(tmp_path):
    from ctopd_jax.algorithms import registry
    from ctopd_jax.config import load_config, load_yaml

    shipped = load_yaml(compare.RECIPES.read_text()) or {}
    assert set(shipped) <= set(registry())
    for name in shipped:   # each recipe loads on its pair's config (unknown keys would be refused)
        tree_path = compare.write_config(name, tmp_path)
        load_config(tree_path, compare.recipe_overrides(name, compare.pair_of(name)))


def test_curves_read_loss_length_and_eos_rate(tmp_path):
    rows = [{"step": 1, "loss": 0.5, "response_length": 30.0, "truncated_samples": 16},
            {"step": 2, "loss": 0.25, "response_length": 28.0, "truncated_samples": 0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compare.curves(tmp_path, 64) == {"loss": [0.5, 0.25], "response_length": [30.0, 28.0],
                                            "eos_rate": [0.75, 1.0]}


def test_table_shows_mean_and_std_over_seeds_and_the_strict_recipe():
    row = {"algorithm": "opd", "pair": "char", "pair_key": "char", "recipe": ["optimizer.lr=0.0003"],
           "teacher": 1.0, "before": 0.3, "after": 0.65, "after_std": 0.05, "seeds": [0, 1, 2],
           "gap_closed": 0.5, "gap_closed_std": 0.0714, "strict_recipe_after": 0.4,
           "strict_recipe_gap_closed": 0.1429, "seconds_per_iteration": 0.5, "time_vs_strict": 0.5,
           "time_vs_opd": 1.0}
    line = compare.markdown_table([row], 100).splitlines()[2]
    assert "0.650 ± 0.050 (n=3)" in line and "50.0% ± 7.1%" in line and "0.400 / 14.3%" in line
    assert "optimizer.lr=0.0003" in line
    assert compare._mean_std([0.6, 0.7, 0.65]) == pytest.approx((0.65, 0.05))
    assert compare._mean_std([0.6]) == (0.6, 0.0) and compare._mean_std([None]) == (None, None)


@pytest.mark.slow
def test_compare_with_seeds_writes_rows_table_and_plot(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes.yaml"
    recipes.write_text("gkd:\n  optimizer.lr: 3.0e-4\n")
    monkeypatch.setattr(compare, "RECIPES", recipes)
    small = ("rollout.rollout_batch_size=8", "optimizer.train_batch_size=8",
             "optimizer.micro_batch_size=8", "checkpoint.async_save=false")
    rows = compare.compare(tmp_path / "cmp", 2, names=["gkd"], problems=4, overrides=small,
                           seeds=(0, 1), log=lambda *_: None)
    assert [(r["algorithm"], r["pair_key"]) for r in rows] == [("strict", "cross"), ("gkd", "char")]
    gkd = rows[1]
    assert "error" not in gkd, gkd.get("error")
    assert gkd["seeds"] == [0, 1] and len(gkd["after_seeds"]) == 2 and len(gkd["curves"]) == 2
    assert all(len(c["loss"]) == 2 and len(c["eos_rate"]) == 2 for c in gkd["curves"])
    assert gkd["recipe"] == ["optimizer.lr=0.0003"] and "strict_recipe_after" in gkd
    assert "strict_recipe_after" not in rows[0]       # strict has no recipe of its own here
    for name in ("compare.md", "compare.json", "compare.png"):
        assert (tmp_path / "cmp" / name).is_file()


def test_strict_recipe_row_only_where_it_differs(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes.yaml"
    recipes.write_text("gkd:\n  optimizer.lr: 3.0e-4\nopd:\n  optimizer.lr: 1.0e-3\n")
    monkeypatch.setattr(compare, "RECIPES", recipes)
    assert compare.recipes_differ("gkd", "char", tmp_path)
    assert not compare.recipes_differ("opd", "char", tmp_path)      # the recipe is tiny_cpu's lr
    assert not compare.recipes_differ("strict", "cross", tmp_path)  # no entry: the pair's config


def test_demo_algorithm_runs_its_recipe_unless_given_a_config(tmp_path):
    from ctopd_jax.config import load_yaml

    shipped = load_yaml(compare.RECIPES.read_text())
    path, recipe = compare.algorithm_config("sage_opd", tmp_path)
    assert recipe == [f"{k}={v}" for k, v in shipped["sage_opd"].items()] and recipe
    assert load_yaml(path.read_text())["rollout"]["environment"] == "calculator"
    _, mine = compare.algorithm_config("sage_opd", tmp_path / "own", base=compare.TOOLS_CONFIG)
    assert mine == []
