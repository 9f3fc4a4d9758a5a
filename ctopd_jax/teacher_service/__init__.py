"""A teacher behind an inference server (vLLM's OpenAI server or SGLang's native one).

The client sends token ids, never text, so the server scores exactly the ids the alignment uses,
and returns per response position the realised token's log-prob and the teacher's top-k.
Modules: transport (HTTP + retries),
vllm_protocol / sglang_protocol (requests and answers), client (batching and concurrency),
startup (the check before training), topk (the teacher-top-k strict and top-k GKD math),
batch_rows (served scores on the teacher batch's flat rows), routing (rows to named teachers),
local_scores / local_server (the local reference and a local vLLM server, for tests and the
benchmark; the demo workload they score is demo/served_inputs.py), launch (`teacher.launch`: a
run that starts and stops its own vLLM server).
The `teacher.*` fields and their checks are the settings' own (config/served.py), shared
with the `teacher:` section. See docs/served_teacher.md.
"""
from ctopd_jax.teacher_service.client import (ServedTeacher, TeacherServiceError,
                                              plan_requests)
from ctopd_jax.teacher_service.scores import ProtocolError, ScoredSequence, ServerInfo
from ctopd_jax.config.served import ENGINES, TeacherServiceSettings, TeacherSettingError
from ctopd_jax.teacher_service.startup import TeacherServerCheckError

__all__ = ["ENGINES", "ProtocolError", "ScoredSequence", "ServedTeacher", "ServerInfo",
           "TeacherServerCheckError", "TeacherServiceError", "TeacherServiceSettings",
           "TeacherSettingError", "plan_requests"]
