"""Inspect a teacher/student tokenizer pair before an expensive run.

    python -m ctopd_jax.inspect_pair --teacher qwen2.5 --student llama3 \\
        [--text FILE] [--show N] [--json] [--no-color]

Prints |V_T|, |V_S|, |V∩| and the Jaccard of the overlap map (SPEC §3). With ``--text`` (one
response per line, or jsonl with a ``response`` or ``text`` field per line) it re-tokenizes
every response after each side's chat prompt and prints strict coverage on both sides, the
byte-mismatch count and the mismatch-group size histogram; ``--show N`` colours how sample N
aligns (green: strict pairs, yellow: mismatch groups, with ``|`` between tokens).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ctopd_jax.align import strict_align
from ctopd_jax.align.strict import describe_byte_mismatch
from ctopd_jax.common.cli import Parser, UserError, at_least, run
from ctopd_jax.tokenization import load_tokenizer_side, overlap_map, retokenize_pair

GREEN, YELLOW, RESET = "\x1b[32m", "\x1b[33m", "\x1b[0m"


def read_responses(path: Path) -> list[str]:
    """Plain text (one response per line) or jsonl ({"response": ...} or {"text": ...})."""
    if not path.is_file():
        raise FileNotFoundError(f"--text: no such file {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"--text: {path} is not UTF-8 text (byte {err.start} is "
                        f"{err.object[err.start]:#04x}); give responses as UTF-8 text lines or "
                        "jsonl") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        raise UserError(f"--text: {path} has no non-empty line")
    if path.suffix == ".jsonl" or lines[0].lstrip().startswith("{"):
        out = []
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"--text: {path}:{n} is not JSON ({err}); use one JSON object "
                                 "per line or plain text") from err
            value = row.get("response", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(value, str):
                raise UserError(f"--text: {path}:{n} has no string 'response' or 'text' field")
            out.append(value)
        return out
    return lines


def token_text(data: bytes) -> str:
    """A token's bytes for display: UTF-8 where they decode, and a byte that is only part of a
    character (an emoji split over several byte-level tokens) as <f0>, never as U+FFFD."""
    out, i = [], 0
    while i < len(data):
        for width in (4, 3, 2, 1):
            try:
                out.append(data[i:i + width].decode("utf-8"))
                i += width
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(f"<{data[i]:02x}>")
            i += 1
    return "".join(out).replace("\n", "\\n")


def colour_view(side, batch, alignment, sample: int, teacher_side: bool, colour: bool) -> str:
    """The response tokens of one side, strict pairs and mismatch groups marked."""
    rows = alignment.teacher_rows if teacher_side else alignment.student_rows
    strict = set((rows[alignment.pair_sample == sample] - batch.row_base[sample]).tolist())
    lo, hi = batch.prompt_lens[sample], batch.prompt_lens[sample] + batch.response_lens[sample]
    parts = []
    for k, token in enumerate(batch.input_ids[sample, lo:hi].tolist()):
        text = token_text(side.token_bytes[token])
        if colour:
            parts.append((GREEN if k in strict else YELLOW) + text + RESET)
        else:
            parts.append(text if k in strict else f"[{text}]")
    return "|".join(parts)


def inspect(teacher_name: str, student_name: str, text: Path | None, show: int | None,
            prompt: str) -> tuple[dict, list[str]]:
    sides = []
    for flag, name in (("--teacher", teacher_name), ("--student", student_name)):
        try:
            sides.append(load_tokenizer_side(name))
        except Exception as err:  # TokenizerLoadError, OSError, the Rust tokenizer's errors
            raise UserError(f"{flag} {name}: {err}") from None
    teacher, student = sides
    report = {"teacher": teacher_name, "student": student_name,
              "overlap": overlap_map(teacher, student).summary()}
    views = []
    if text is not None:
        responses = read_responses(text)
        t_batch, s_batch = retokenize_pair(
            teacher, student, [teacher.render_prompt(prompt)] * len(responses),
            [student.render_prompt(prompt)] * len(responses), responses)
        alignment = strict_align(t_batch, s_batch)
        report["alignment"] = {
            "samples": len(responses),
            "student_coverage": alignment.student_coverage,
            "teacher_coverage": alignment.teacher_coverage,
            "strict_pairs": alignment.num_pairs,
            "student_response_tokens": alignment.num_student_response_tokens,
            "teacher_response_tokens": int(alignment.teacher_response_tokens.sum()),
            "byte_mismatch_samples": alignment.num_byte_mismatch,
            "mismatch_groups": {f"{a}:{b}": c for (a, b), c in
                                sorted(alignment.mismatch_size_histogram().items())},
        }
        if alignment.num_byte_mismatch:
            first = int(alignment.byte_mismatch.argmax())
            report["alignment"]["first_byte_mismatch"] = describe_byte_mismatch(
                t_batch, s_batch, first)
        if show is not None:
            if not 0 <= show < len(responses):
                raise UserError(f"--show: sample {show} out of range [0, {len(responses)})")
            views = [(teacher, t_batch, True), (student, s_batch, False), show, alignment]
    return report, views


PROG = "python -m ctopd_jax.inspect_pair"


def main(argv: list[str] | None = None) -> int:
    return run(_main, argv, PROG)


def _main(argv: list[str]) -> int:
    parser = Parser(prog=PROG, description=__doc__)
    parser.add_argument("--teacher", required=True,
                        help="tokenizer directory or tiny_bpe / tiny_unigram / qwen2.5 / llama3")
    parser.add_argument("--student", required=True, help="as --teacher")
    parser.add_argument("--text", type=Path, help="responses: text lines or jsonl")
    parser.add_argument("--show", type=at_least(0), help="colour the alignment of this sample")
    parser.add_argument("--prompt", default="Solve the problem.",
                        help="user message rendered before every response")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-color", action="store_true")
    args = parser.parse_args(argv)
    report, views = inspect(args.teacher, args.student, args.text, args.show, args.prompt)
    colour = not args.no_color and sys.stdout.isatty() and not args.json
    if views:
        (t, tb, _), (s, sb, _), sample, alignment = views
        report.setdefault("alignment", {})["view"] = {
            "teacher": colour_view(t, tb, alignment, sample, True, colour),
            "student": colour_view(s, sb, alignment, sample, False, colour)}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    o = report["overlap"]
    print(f"teacher {report['teacher']}: |V_T| = {o['V_T']:,}")
    print(f"student {report['student']}: |V_S| = {o['V_S']:,}")
    print(f"shared ({o['rule']} rule): |V∩| = {o['V_shared']:,}  Jaccard = {100 * o['jaccard']:.2f}%"
          + ("  (EOS pair appended)" if o["eos_pair_appended"] else ""))
    a = report.get("alignment")
    if a:
        print(f"{a['samples']} responses: strict coverage student {100 * a['student_coverage']:.2f}%"
              f" ({a['strict_pairs']:,}/{a['student_response_tokens']:,}), teacher "
              f"{100 * a['teacher_coverage']:.2f}% ({a['strict_pairs']:,}/"
              f"{a['teacher_response_tokens']:,}); byte-mismatched samples "
              f"{a['byte_mismatch_samples']}")
        groups = ", ".join(f"{k} -> {v}" for k, v in a["mismatch_groups"].items())
        print("mismatch groups (teacher:student tokens -> count): "
              + (groups or "none (every token is in a strict pair)"))
        if "first_byte_mismatch" in a:
            print(f"first byte mismatch: {a['first_byte_mismatch']}")
        if "view" in a:
            print(f"teacher: {a['view']['teacher']}\nstudent: {a['view']['student']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
