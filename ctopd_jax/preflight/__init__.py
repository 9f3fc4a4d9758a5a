"""Every cheap check of a run, before any model weight is loaded.

    with preflight(config, resume=args.resume, allow_config_change=args.allow_config_change) as pre:
        start_served_teachers(pre)   # a teacher behind a server: started after the checks
        ...  # pre.prompts, pre.student_tokenizer, pre.teachers[name].tokenizer / .overlap, pre.mesh_shape

`preflight` reads no tensor data and writes nothing. It raises `PreflightError` (one line
naming the field or file and the fix) for the first problem in this order:

1. the config values themselves (`config.validate`; the environment name against envs/),
   the algorithm name (registered in
   `ctopd_jax.algorithms.registry()`), vLLM present when `rollout.engine=vllm` (and in
   `teacher.launch_python` when `teacher.launch`);
2. the mesh against the device count (with the XLA_FLAGS hint on CPU);
   the output folders: `output_dir` and `checkpoint.dir` are folders (or can be created) on a
   writable file system, and no live run holds `output_dir` (`run_dir`);
3. the checkpoint directory: checkpoints present without `--resume`; `--resume` with none, or
   with none whose meta is readable, or with `steps` below the newest step; the saved config
   against the new one
   (`resume_config.check_resume_config`, `--allow-config-change`);
4. the prompt file and every row of it (with `teachers:`, each row's teacher); the evaluation set when `evaluation.dataset` is set
   (its prompts must also fit the training engine and the student's positions, step 7);
5. each model (`model.teacher_base` too, when set): a checkpoint directory (`config.json`
   valid, every `*.safetensors` shard's header readable and not truncated, every tensor the
   config implies present with its shape) or a preset name; `lora.init_adapter`'s folder, its
   settings against `lora:` and its weights header. A teacher behind a server
   (`teacher.engine` vllm_server / sglang_server): its folder's config.json only (the
   objective's fitness for it, `Needs.teacher_scores` token_logprobs or topk, no teacher
   sampling, kd_temperature 1 for token log-probs, is checked with the objective);
6. the tokenizers (`model.*_tokenizer`, or the model directory's own), each model's vocabulary
   against its tokenizer, the shared vocabulary V∩ non-empty, and the objective's own check
   against the pair (`algorithm.ctkd_topk <= |V∩|` for top-k objectives);
7. at least one prompt fits `rollout.max_prompt_len` once rendered with the student's chat
   template, and the longest one that fits plus `rollout.generate_max_len` stays within the
   student's `max_position_embeddings`; every rendered prompt encodes on both sides without
   the unknown token (a tokenizer without byte fallback meeting a character it lacks);
8. not a check: after them the caller starts the served teachers,
   `start_served_teachers(pre)` (served_start.py), the one step that talks to another process:
   the server when `teacher.launch` (teacher_service/launch.py), then the client's start-up
   check (ServedTeacher.start: up, right engine, model and vocabulary). What it started belongs
   to the Preflight: `with preflight(...) as pre` (or `pre.close()`) stops it; a failed start
   stops what had started.

With `teachers:` steps 5-8 run for each teacher on its view of the config
(`config.teacher_views`); a failure names the entry (`teachers[math] (as model.teacher /
teacher:): ...`). Several teachers are refused for objectives built for one teacher
(`_check_several_teachers`).

Decisions: vLLM is checked with `importlib.util.find_spec` (importing it takes tens of seconds;
a broken install still fails at engine start with its own message). The demo prompt file
(`data.path: demo:train`) is written to the cache by its owner module as before.

One module per job (the objective factory it runs first is ctopd_jax/loop/objective_factory.py):
`settings` (packages, the mesh, the environment name), `checkpoints` (output folders, checkpoints, resume),
`data` (prompt rows, the evaluation set), `models` and `safetensors` (checkpoint folders from
their headers, the LoRA adapter), `tokenizers` (tokenizers, the overlap, prompts encoded),
`run` (`preflight` itself, in the order above), `served_start` (step 8).
"""
from ctopd_jax.common.setup_errors import PreflightError
from ctopd_jax.loop.objective_factory import check_objective
from ctopd_jax.preflight.checkpoints import checkpoint_dir_of
from ctopd_jax.preflight.run import Preflight, TeacherChecks, preflight
from ctopd_jax.preflight.safetensors import (MAX_HEADER_BYTES, check_hf_checkpoint,
                                             expected_hf_shapes, read_safetensors_header)
from ctopd_jax.preflight.served_start import start_served_teachers

__all__ = ["MAX_HEADER_BYTES", "Preflight", "PreflightError", "TeacherChecks",
           "check_hf_checkpoint", "check_objective", "checkpoint_dir_of", "expected_hf_shapes",
           "preflight", "read_safetensors_header", "start_served_teachers"]
