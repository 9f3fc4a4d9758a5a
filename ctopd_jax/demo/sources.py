"""The demo's named sources (see ctopd_jax.common.sources): `demo:teacher` / `demo:student` models (the
cross-tokenizer pair), `demo:char_teacher` / `demo:char_student` / `demo:char_teacher_base` (the
same-tokenizer character pair, ctopd_jax/assets/demo_char/, for the OPD family),
`demo:train` / `demo:held_out` prompt files and the `demo:held_out` evaluation set; and the
tool-use task (tools_task.py): `demo:char_tools_teacher` / `demo:char_tools_student` models
(ctopd_jax/assets/demo_char_tools/), `demo:tools_train` / `demo:tools_held_out` prompt files and
the `demo:tools_held_out` evaluation set."""
from __future__ import annotations

from pathlib import Path

from ctopd_jax.common import sources
from ctopd_jax.data.eval_sets import EvalDataset, EvalProblem
from ctopd_jax.demo import data, task, tools_task

TOOLS_PREFIX = "tools_"


def evaluation_set(split: str):
    """The demo's split as an evaluation set, graded by the task's own grader (`tools_held_out`:
    the tool-use task's held-out split, whose responses are full transcripts)."""
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


# the committed character pairs: model name prefix -> (asset folder, roles, `pretrain --pair`)
CHAR_PAIRS = {"char_tools_": ("demo_char_tools", ("teacher", "student"), "char_tools"),
              "char_": ("demo_char", ("teacher", "student", "teacher_base"), "char")}


def char_checkpoint_dir(prefix: str, role: str) -> Path:
    """The committed checkpoint of a character pair's `role` (demo:<prefix><role>)."""
    folder, roles, pair = CHAR_PAIRS[prefix]
    if role not in roles:
        raise ValueError(f"demo model {prefix}{role!r} is unknown; use one of "
                         f"{', '.join('demo:' + prefix + r for r in roles)}")
    path = data.ASSET_DIR.parent / folder / role
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no checkpoint; rebuild it with "
                                f"`python -m ctopd_jax.demo.pretrain --pair {pair}`")
    return path


def model_dir(name: str) -> Path:
    prefix = next((p for p in CHAR_PAIRS if name.startswith(p)), None)   # longest prefix first
    if prefix is not None:
        return char_checkpoint_dir(prefix, name[len(prefix):])
    return data.checkpoint_dir(name)


def prompt_file(name: str) -> Path:
    """`demo:train` / `demo:held_out` (data.py) or `demo:tools_train` / `demo:tools_held_out`."""
    if name.startswith(TOOLS_PREFIX):
        return tools_task.prompt_file(name[len(TOOLS_PREFIX):])
    return data.prompt_file(name)


sources.register("model", "demo", model_dir)
sources.register("prompts", "demo", prompt_file)
sources.register("dataset", "demo", evaluation_set)
