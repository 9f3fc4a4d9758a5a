"""The response format's purpose: under the demo pair (tiny_bpe teacher, tiny_unigram student),
every result digit of a reference solution is a strict 1:1 pair, so the strict objective
supervises exactly the tokens the student must get right, and every teacher token of a
reference solution has a column in the shared vocabulary V∩."""
import re

import numpy as np
import pytest

from ctopd_jax.align import strict_align
from ctopd_jax.demo import task
from ctopd_jax.tokenization import load_tokenizer_side, overlap_map, retokenize_pair


@pytest.fixture(scope="module")
def aligned():
    teacher, student = load_tokenizer_side("tiny_bpe"), load_tokenizer_side("tiny_unigram")
    problems = task.split("held_out")
    responses = [p.solution for p in problems]
    t_rt, s_rt = retokenize_pair(
        teacher, student, [teacher.render_prompt(p.prompt) for p in problems],
        [student.render_prompt(p.prompt) for p in problems], responses)
    return teacher, student, responses, t_rt, s_rt, strict_align(t_rt, s_rt)


def test_result_digits_are_strict_pairs(aligned):
    _, _, responses, _, s_rt, alignment = aligned
    assert alignment.num_byte_mismatch == 0
    paired = set(alignment.student_rows.tolist())
    for b, response in enumerate(responses):
        # byte offsets of the two step results, found from the text alone: the digit after "="
        results = [m.start(1) for m in re.finditer(r"=(\d)", response)]
        assert len(results) == 2
        lo, hi = s_rt.resp_offsets[b], s_rt.resp_offsets[b + 1]
        ends = np.cumsum(s_rt.resp_byte_len[lo:hi])
        for offset in results:
            k = int(np.searchsorted(ends, offset, side="right"))   # student token holding it
            assert ends[k] - offset == 1 and s_rt.resp_byte_len[lo + k] == 1, response
            assert int(s_rt.row_base[b]) + k in paired, response
    assert 0.9 < alignment.student_coverage < 1.0     # a few "▁", "1" / "Ġ1" groups remain
    assert len(alignment.mismatch_groups) > 0


def test_every_teacher_token_of_a_reference_solution_is_in_the_shared_vocabulary(aligned):
    teacher, student, _, t_rt, _, _ = aligned
    shared = overlap_map(teacher, student)
    assert np.isin(t_rt.resp_ids, shared.t_ids).all()
