"""Final-answer extraction from a model response.

SPEC §10: take the last ``\\boxed{...}`` with brace matching. ``\\fbox{...}`` is accepted as a
synonym, and the brace-less form ``\\boxed 5`` (which LaTeX also renders) takes the next token.

Fallbacks (only when a dataset asks for them, see ``extract_answer(..., fallbacks=True)``):
GSM8K references and GSM8K-style generators end with ``#### 42``; chatty models and the demo's
synthetic task write ``The answer is 42``; DAPO-style prompts ask for ``Answer: 42``; a prompt
that asks for "only the number" gets a bare ``42`` (a response that is one number and nothing
else, a final period allowed). These are tried only when no box is present, in the order
``####``, ``answer is``, then the bare number, each taking its last occurrence. MATH-style datasets keep
the strict boxed-only rule of the harness, so a response without a box scores zero there.
"""
from __future__ import annotations

import re

_BOX_COMMANDS = ("\\boxed", "\\fbox")

# "#### 42" up to the end of its line (GSM8K reference format).
_HASHES = re.compile(r"####\s*([^\n]*)")
# "The (final) answer is: 42." up to the end of its line; the trailing period is dropped later
# by normalisation. Bounded character classes keep the regex linear on long responses.
_ANSWER_IS = re.compile(r"answer(?:\s+is\s*:?|\s*:)\s*([^\n]*)", re.IGNORECASE)
_LEADING_NUMBER = re.compile(r"\$?-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?")
# A whole response that is one number: "42", " -7.5.", "$1,200" (not "42 apples", not "4 + 5").
_BARE_NUMBER = re.compile(r"\s*(\$?-?\d[\d,]*(?:\.\d+)?(?:/\d+)?%?)\s*\.?\s*")


def _match_braces(text: str, open_index: int) -> int | None:
    """Index of the brace closing the one at ``open_index``; None if never closed.

    ``\\{`` and ``\\}`` are literal braces in LaTeX (set notation), so they do not count.
    """
    depth = 0
    i = open_index
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` / ``\\fbox{...}`` in ``text``, or None.

    An unclosed last box yields None (a truncated response has no final answer) rather than
    falling back to an earlier box, which would credit an answer the model moved past.
    """
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    i = start + len(cmd)
    if i < len(text) and (text[i].isalpha()):
        # "\boxedx" is a different control word; look for an earlier genuine box.
        return last_boxed(text[:start])
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text):
        return None
    if text[i] == "{":
        end = _match_braces(text, i)
        if end is None:
            return None
        return text[i + 1:end]
    # "\boxed 5" form: the argument runs to the next space, "$" or end of text.
    m = re.match(r"[^\s$]+", text[i:])
    return m.group(0) if m else None


def _last_match(pattern: re.Pattern, text: str) -> str | None:
    last = None
    for m in pattern.finditer(text):
        last = m
    if last is None:
        return None
    value = last.group(1).strip()
    return value or None


def extract_answer(text: str, fallbacks: bool = False) -> str | None:
    """The final answer string of a response (un-normalised), or None if there is none."""
    boxed = last_boxed(text)
    if boxed is not None or not fallbacks:
        return boxed
    hashed = _last_match(_HASHES, text)
    if hashed is not None:
        return hashed
    said = _last_match(_ANSWER_IS, text)
    if said is None:
        bare = _BARE_NUMBER.fullmatch(text)
        return bare.group(1) if bare else None
    # "The answer is 42 apples." -> "42": a leading number followed by words keeps the number.
    lead = _LEADING_NUMBER.match(said)
    if lead and said[lead.end():].strip(" .") and said[lead.end():].lstrip()[:1].isalpha():
        return lead.group(0)
    return said
