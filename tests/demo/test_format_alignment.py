"""The response format's purpose: under the demo pair (tiny_bpe teacher, tiny_unigram student),
every result digit of a reference solution is a strict 1:1 pair, so the strict objective
supervises exactly the tokens the student must get right, while other parts of the response
still form mismatch groups (coverage well below 1)."""
import re

import numpy as np

from ctopd_jax.align import strict_align
from ctopd_jax.demo import task
from ctopd_jax.tokenization import load_tokenizer_side, retokenize_pair


def test_result_digits_are_strict_pairs_and_coverage_is_partial():
    teacher, student = load_tokenizer_side("tiny_bpe"), load_tokenizer_side("tiny_unigram")
    problems = task.split("held_out")
    responses = [p.solution for p in problems]
    t_rt, s_rt = retokenize_pair(
        teacher, student, [teacher.render_prompt(p.prompt) for p in problems],
        [student.render_prompt(p.prompt) for p in problems], responses)
    alignment = strict_align(t_rt, s_rt)
    assert alignment.num_byte_mismatch == 0
    paired = set(alignment.student_rows.tolist())
    for b, response in enumerate(responses):
        # byte offsets of the two step results, found by the text alone: the digit after ")="
        results = [m.start(1) for m in re.finditer(r"\)=(\d)", response)]
        assert len(results) == 2
        lo, hi = s_rt.resp_offsets[b], s_rt.resp_offsets[b + 1]
        ends = np.cumsum(s_rt.resp_byte_len[lo:hi])
        for offset in results:
            k = int(np.searchsorted(ends, offset, side="right"))   # student token holding it
            assert ends[k] - offset == 1 and s_rt.resp_byte_len[lo + k] == 1, response
            assert int(s_rt.row_base[b]) + k in paired, response
    assert 0.5 < alignment.student_coverage < 1.0
    assert len(alignment.mismatch_groups) >= len(problems)   # "The answer is" never aligns fully
