"""Chat templates rendered with jinja2 the way HF chat templates expect (SPEC §1.1).

The environment mirrors the conventions templates are written for: ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII,
``raise_exception`` and ``strftime_now`` globals, sandboxed execution. The tests compare the
output with ``transformers``' ``apply_chat_template`` on the same template.
"""
from __future__ import annotations

import datetime
import functools
import json

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


# Llama-3 Instruct's turn layout; the real Llama-3 tokenizer and the demo's tiny_unigram use it.
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


class ChatTemplateError(ValueError):
    """A template that is missing, does not compile, or raises while rendering."""


def _raise_exception(message):
    raise ChatTemplateError(f"chat template raised: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"chat_template does not compile (line {err.lineno}): {err}") from err


def render_chat(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                special_tokens: dict | None = None, **extra) -> str:
    """Render ``messages`` ([{"role", "content"}, ...]) to the prompt string."""
    if not template:
        raise ChatTemplateError("chat_template: this tokenizer has none; put a `chat_template` "
                                "in its tokenizer_config.json (or chat_template.jinja)")
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages):
        raise ChatTemplateError("messages: expected a list of {'role': ..., 'content': ...} dicts")
    context = dict(special_tokens or {})
    context.update(extra)
    try:
        return compile_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"chat_template failed to render: {err}") from err
