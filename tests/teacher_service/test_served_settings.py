"""Every bad teacher setting is one line that names the field and says the fix."""
import pytest

from ctopd_jax.teacher_service import TeacherServiceSettings, TeacherSettingError

SERVED = dict(engine="vllm_server", url="http://127.0.0.1:8000")


def error_of(prefix="teacher", **fields):
    with pytest.raises(TeacherSettingError) as info:
        TeacherServiceSettings(**fields).validate(prefix)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("fields, field, fix", [
    (dict(engine="vllm"), "teacher.engine", "local, vllm_server, sglang_server"),
    (dict(engine="local", url="http://x:1"), "teacher.url", "remove teacher.url"),
    (dict(engine="vllm_server"), "teacher.url", "http://127.0.0.1:8000"),
    (dict(engine="sglang_server", url="127.0.0.1:30000"), "teacher.url", "http://127.0.0.1:8000"),
    (dict(engine="vllm_server", url="ftp://host:1"), "teacher.url", "http://127.0.0.1:8000"),
    (dict(engine="vllm_server", url="http://host:99999"), "teacher.url", "bad port"),
    (dict(engine="vllm_server", url="http://host:8000/v1"), "teacher.url", "server root"),
    (dict(SERVED, timeout_s=0), "teacher.timeout_s", "(0, 3600]"),
    (dict(SERVED, timeout_s=float("nan")), "teacher.timeout_s", "finite"),
    (dict(SERVED, timeout_s="60"), "teacher.timeout_s", "finite"),
    (dict(SERVED, max_concurrency=0), "teacher.max_concurrency", "[1, 256]"),
    (dict(SERVED, max_concurrency=2.5), "teacher.max_concurrency", "whole number"),
    (dict(SERVED, max_concurrency=True), "teacher.max_concurrency", "whole number"),
    (dict(SERVED, retries=-1), "teacher.retries", "[0, 20]"),
    (dict(SERVED, retries=100), "teacher.retries", "[0, 20]"),
    (dict(SERVED, backoff_s=-0.1), "teacher.backoff_s", "[0, 60]"),
    (dict(SERVED, top_k=0), "teacher.top_k", "[1, 1024]"),
    (dict(SERVED, top_k=5000), "teacher.top_k", "[1, 1024]"),
    (dict(SERVED, max_tokens_per_request=1), "teacher.max_tokens_per_request", "[2, "),
    (dict(launch=True), "teacher.launch", "set teacher.engine: vllm_server"),
    (dict(engine="sglang_server", launch=True), "teacher.launch", "start the server yourself"),
    (dict(SERVED, launch=True), "teacher.url", "remove teacher.url or set teacher.launch: false"),
    (dict(SERVED, launch_python="/usr/bin/python3"), "teacher.launch_python", "teacher.launch: true"),
    (dict(engine="vllm_server", launch="yes"), "teacher.launch", "true or false"),
    (dict(engine="vllm_server", launch=True, launch_python=3), "teacher.launch_python", "path"),
    (dict(engine="vllm_server"), "teacher.url", "teacher.launch: true to start one"),
])
def test_bad_setting_is_one_line_naming_the_field(fields, field, fix):
    message = error_of(**fields)
    assert message.startswith(field + ":"), message
    assert fix in message, message


def test_prefix_names_the_entry_of_a_teacher_list():
    message = error_of("teachers[math]", engine="sglang_server", url="", top_k=3)
    assert message.startswith("teachers[math].url:")


def test_good_settings_pass_and_local_needs_nothing():
    assert TeacherServiceSettings().validate().served is False
    settings = TeacherServiceSettings(engine="sglang_server", url="http://10.0.0.5:30000/",
                                      top_k=64, retries=0, backoff_s=0)
    assert settings.validate() is settings
    assert settings.base_url == "http://10.0.0.5:30000"
    launched = TeacherServiceSettings(engine="vllm_server", launch=True, launch_python="python3")
    assert launched.validate() is launched   # no url: the run's own server gets one
