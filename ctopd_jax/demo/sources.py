"""The demo's named sources (see ctopd_jax.sources): `demo:teacher` / `demo:student` models (the
cross-tokenizer pair), `demo:char_teacher` / `demo:char_student` / `demo:char_teacher_base` (the
same-tokenizer character pair, ctopd_jax/assets/demo_char/, for the OPD family),
`demo:train` / `demo:held_out` prompt files and the `demo:held_out` evaluation set; and the
tool-use task (tools_task.py): `demo:char_tools_teacher` / `demo:char_tools_student` models
(ctopd_jax/assets/demo_char_tools/), `demo:tools_train` / `demo:tools_held_out` prompt files and
the `demo:tools_held_out` evaluation set."""
from __future__ import annotations

from pathlib import Path

from ctopd_jax import sources
from ctopd_jax.demo import data, task, tools_task


TOOLS_PREFIX = "tools_"


def evaluation_set(split: str):
    """The demo's split as an evaluation set, graded by the task's own grader (`tools_held_out`:
    the tool-use task's held-out split, whose responses are full transcripts)."""
    from ctopd_jax.datasets import EvalDataset, EvalProblem

    if split.startswith(TOOLS_PREFIX):
        name = split[len(TOOLS_PREFIX):]
        problems = [EvalProblem(f"demo_tools:{i}", p.prompt, str(p.answer), None,
                                f"demo tools {name}") for i, p in enumerate(tools_task.split(name))]
        return EvalDataset("demo_tools", problems, answer_fallbacks=True, system_prompt=None,
                           grade_fn=lambda response, answer: tools_task.grade(response, answer))
    problems = [EvalProblem(f"demo:{i}", p.prompt, str(p.answer), None, f"demo {split}")
                for i, p in enumerate(task.split(split))]
    return EvalDataset("demo", problems, answer_fallbacks=True, system_prompt=None,
                       grade_fn=lambda response, answer: task.grade(response, answer))


CHAR_ROLES = ("teacher", "student", "teacher_base")


def char_checkpoint_dir(role: str) -> Path:
    """The committed checkpoint of the character pair's `role` (demo:char_<role>)."""
    if role not in CHAR_ROLES:
        raise ValueError(f"demo model char_{role!r} is unknown; use one of "
                         f"{', '.join('demo:char_' + r for r in CHAR_ROLES)}")
    path = data.ASSET_DIR.parent / "demo_char" / role
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no checkpoint; rebuild it with "
                                "`python -m ctopd_jax.demo.pretrain --pair char`")
    return path


CHAR_TOOLS_ROLES = ("teacher", "student")


def char_tools_checkpoint_dir(role: str) -> Path:
    """The committed checkpoint of the tool-use character pair's `role` (demo:char_tools_<role>)."""
    if role not in CHAR_TOOLS_ROLES:
        raise ValueError(f"demo model char_tools_{role!r} is unknown; use one of "
                         f"{', '.join('demo:char_tools_' + r for r in CHAR_TOOLS_ROLES)}")
    path = data.ASSET_DIR.parent / "demo_char_tools" / role
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no checkpoint; rebuild it with "
                                "`python -m ctopd_jax.demo.pretrain --pair char_tools`")
    return path


def model_dir(name: str) -> Path:
    if name.startswith("char_tools_"):
        return char_tools_checkpoint_dir(name[len("char_tools_"):])
    if name.startswith("char_"):
        return char_checkpoint_dir(name[len("char_"):])
    return data.checkpoint_dir(name)


def prompt_file(name: str) -> Path:
    """`demo:train` / `demo:held_out` (data.py) or `demo:tools_train` / `demo:tools_held_out`."""
    if name.startswith(TOOLS_PREFIX):
        return tools_task.prompt_file(name[len(TOOLS_PREFIX):])
    return data.prompt_file(name)


sources.register("model", "demo", model_dir)
sources.register("prompts", "demo", prompt_file)
sources.register("dataset", "demo", evaluation_set)
