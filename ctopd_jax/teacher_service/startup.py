"""The start-up check of a served teacher: before any training, is the right model there?

In order, each failure one line naming `teacher.url` and the fix (TeacherServerCheckError, a
ValueError so the CLI reports it like a bad setting):
1. the server answers at all (else: start it, or correct teacher.url);
2. it answers like the configured engine (GET /v1/models or /get_model_info; else: check
   teacher.engine), where a 5xx there is a failing server (check its log), not a wrong engine;
3. it serves `teacher.model` when that is set (the served name or model path);
4. its vocabulary has exactly `vocab_size` rows: a probe scoring [0, V-1] must succeed and one
   with id V must be refused (both engines refuse ids outside the model's vocabulary), so a
   server of another model family (a different V) is caught even when names say nothing;
5. the probe's answer parses, with `top_k` entries per position (else: the server's top-k limit,
   vLLM's --max-logprobs).
`vocab_size` is the teacher model's own row count (config.json `vocab_size`), the same number the
overlap map's teacher ids index into.
"""
from __future__ import annotations

from ctopd_jax.teacher_service.scores import ProtocolError, ServerInfo
from ctopd_jax.teacher_service.transport import ServerError


class TeacherServerCheckError(ValueError):
    """The served teacher failed its start-up check: one line naming teacher.url and the fix."""


def check_server(teacher, vocab_size: int) -> ServerInfo:
    settings, prefix, protocol = teacher.settings, teacher.prefix, teacher.protocol
    where = f"{prefix}.url {settings.url}"
    engine = settings.engine

    def fail(message: str):
        raise TeacherServerCheckError(f"{where}: {message}")

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size={vocab_size!r} must be the teacher's vocabulary size (>= 2)")
    try:
        info = protocol.server_info(teacher.transport.get)
    except ServerError as err:
        if err.status is None:
            fail(f"no server answers ({err}); start the teacher server ({protocol.ENDPOINTS.start_command})"
                 f" or correct {prefix}.url")
        if err.status >= 500:  # it is the engine's server, but failing: not a wrong engine
            fail(f"the server answers but fails ({err}); it is up and broken (still loading, "
                 f"out of memory, a crashed engine): check its log and restart it")
        fail(f"does not answer as {prefix}.engine: {engine} expects ({err}); check {prefix}.engine "
             f"(vllm_server or sglang_server) and {prefix}.url")
    except ProtocolError as err:
        fail(f"does not answer as {prefix}.engine: {engine} expects ({err}); check {prefix}.engine")
    if settings.model and settings.model not in info.names:
        fail(f"serves {info.names[0]!r}, not {prefix}.model {settings.model!r}; point {prefix}.url "
             f"at the server of {settings.model!r} or correct {prefix}.model")
    teacher.info = info

    top_fix = protocol.ENDPOINTS.top_k_fix.format(k=settings.top_k, prefix=prefix)
    try:
        probe = teacher.score([[0, vocab_size - 1]], [1])[0]
    except Exception as err:  # noqa: BLE001 - each cause is turned into its own line below
        cause = err.__cause__ or err
        message = str(cause)
        if protocol.is_out_of_vocabulary(message):
            fail(f"serves a model with fewer than the teacher's {vocab_size} vocabulary rows (it "
                 f"refuses id {vocab_size - 1}): another model; serve the teacher's checkpoint")
        if protocol.is_top_k_limit(message):
            fail(f"{prefix}.top_k={settings.top_k} is above the server's limit; {top_fix}")
        fail(f"the probe request failed ({_last_part(message)}); check the server's log and "
             f"{prefix}.engine")
    if probe.topk_ids.shape != (1, settings.top_k):
        fail(f"answered {probe.topk_ids.shape[-1]} top log-probs where {prefix}.top_k="
             f"{settings.top_k} were asked; {top_fix}")
    try:
        teacher.score([[0, vocab_size]], [1])
    except Exception as err:  # noqa: BLE001
        if protocol.is_out_of_vocabulary(str(err)):
            return info
        fail(f"the vocabulary probe failed ({_last_part(str(err))}); check the server's log")
    fail(f"serves a model with more than the teacher's {vocab_size} vocabulary rows (it accepts "
         f"id {vocab_size}): another model; serve the teacher's checkpoint or fix the teacher's "
         f"vocab_size")


def _last_part(message: str) -> str:
    return message.split(": ", 1)[-1][:300]
