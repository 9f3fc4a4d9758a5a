"""benchmarks/recipe_sweep.py plans what it is asked for: the shipped recipe over seeds, chosen
knob settings at a given lr, and run ids that name every setting."""
import importlib.util
from pathlib import Path

from ctopd_jax.demo import compare

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "recipe_sweep.py"


def sweep_module():
    spec = importlib.util.spec_from_file_location("recipe_sweep", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shipped_phase_plans_the_recipe_file_over_the_seeds(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes.yaml"
    recipes.write_text("opd2:\n  optimizer.lr: 1.0e-4\n  model.teacher_base: demo:char_student\n"
                       "vopd:\n  algorithm.opd_clip: ppo\n")
    monkeypatch.setattr(compare, "RECIPES", recipes)
    sweep = sweep_module()
    assert sweep.planned("shipped", "opd2", tmp_path, [0, 2]) == [
        (1e-4, {"model.teacher_base": "demo:char_student"}, 0),
        (1e-4, {"model.teacher_base": "demo:char_student"}, 2)]
    # no lr in the entry: the pair's config's lr (tiny_cpu_same.yaml)
    assert sweep.planned("shipped", "vopd", tmp_path, [1]) == [(1e-3, {"opd_clip": "ppo"}, 1)]


def test_knobs_at_a_given_lr_run_without_earlier_runs(tmp_path):
    sweep = sweep_module()
    assert sweep.planned("knobs", "gkd", tmp_path, [0], lr=3e-4, settings=[{"gkd_beta": 1.0}]) == [
        (3e-4, {"gkd_beta": 1.0}, 0)]
    assert sweep.planned("knobs", "gkd", tmp_path, [0]) == []    # no best lr yet and none given
    assert sweep.planned("seeds", "gkd", tmp_path, [0], lr=3e-4) == []
    assert sweep.run_id(3e-4, {"rollout.top_p": 0.95, "opd_clip": "ppo"}, 1) == \
        "lr0.0003__opd_clip-ppo__rollout.top_p-0.95__s1"
    # a path among the values stays one file name (not folders)
    assert sweep.run_id(1e-4, {"model.teacher_base": "/tmp/base"}, 0) == "lr0.0001__model.teacher_base-_tmp_base__s0"
