"""Micro-batch slicing of a real re-tokenized, aligned batch keeps every row pointing at the
same token, each micro-batch is padded to its own length bucket, and packing pads with
weight-0 rows only."""
import numpy as np

from ctopd_jax.algorithms.padded_rows import length_bucket, rows_bucket
from ctopd_jax.algorithms.strict import strict_inputs
from ctopd_jax.align import strict_align
from ctopd_jax.collect.collector import HostBatch
from ctopd_jax.tokenization.retokenize import retokenize_pair
from ctopd_jax.tokenization.side import load_tokenizer_side


def test_slices_rebase_rows_to_the_same_tokens():
    s_tok, t_tok = load_tokenizer_side("tiny_unigram"), load_tokenizer_side("tiny_bpe")
    messages = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((3, 4), (12, 7), (5, 5), (8, 1))]
    responses = ["(3+4)=7. The answer is 7.", "12 plus 7 is 19 " * 24, "The answer is 10.", "9"]
    t_rt, s_rt = retokenize_pair(t_tok, s_tok, [t_tok.render_chat(m) for m in messages],
                                 [s_tok.render_chat(m) for m in messages], responses, pad_to_multiple=16)
    alignment = strict_align(t_rt, s_rt)
    assert alignment.num_pairs > 0
    lp = (np.arange(int(s_rt.loss_mask.sum()), dtype=np.float32), np.ones(int(s_rt.loss_mask.sum()), np.float32))
    host = HostBatch(s_rt, t_rt, alignment, lp, responses, [])
    seen_pairs, seen_rows = 0, 0
    for start in (0, 2):
        mb = strict_inputs(host, start, start + 2)
        longest = s_rt.attention_mask[start:start + 2].sum(1).max()
        assert mb.student_ids.shape[1] == length_bucket(longest)  # its own bucket
        assert mb.teacher_rows is mb.terms.strict_teacher_rows
        sel = (alignment.pair_sample >= start) & (alignment.pair_sample < start + 2)
        n = int(sel.sum())
        w = mb.terms.strict_weight
        assert w[:n].all() and not w[n:].any() and len(w) == rows_bucket(n, 64)
        # the token each strict row predicts is the token the whole-batch row predicts
        np.testing.assert_array_equal(mb.student_ids.reshape(-1)[mb.terms.strict_student_rows[:n] + 1],
                                      s_rt.input_ids.reshape(-1)[alignment.student_rows[sel] + 1])
        np.testing.assert_array_equal(mb.teacher_ids.reshape(-1)[mb.terms.strict_teacher_rows[:n] + 1],
                                      t_rt.input_ids.reshape(-1)[alignment.teacher_rows[sel] + 1])
        r = int(s_rt.loss_mask[start:start + 2].sum())
        assert mb.response_weight[:r].all() and not mb.response_weight[r:].any()
        np.testing.assert_array_equal(mb.response_targets[:r],
                                      mb.student_ids.reshape(-1)[mb.response_rows[:r] + 1])
        np.testing.assert_array_equal(mb.rollout_logprobs[:r], lp[0][seen_rows:seen_rows + r])
        seen_pairs, seen_rows = seen_pairs + n, seen_rows + r
    assert seen_pairs == alignment.num_pairs and seen_rows == s_rt.num_response_tokens
    assert s_rt.seq_len > 64  # the long sample made the whole batch longer than one bucket


def test_length_buckets_are_few():
    assert [length_bucket(n) for n in (1, 64, 65, 500, 513, 769, 1025, 2049, 5000, 8192)] == \
        [64, 64, 128, 512, 768, 1024, 1536, 3072, 6144, 8192]
    assert len({length_bucket(n) for n in range(1, 10241)}) == 17  # 8 steps of 64, then 9 more


def test_sort_by_length_keeps_each_optimizer_batch():
    from ctopd_jax.collect.collector import sort_by_length
    from ctopd_jax.rollout.base import RolloutResult

    lengths = [3, 9, 1, 4, 7, 2, 8, 5]
    result = RolloutResult([[1]] * 2, [[0] * n for n in lengths], [[0.0] * n for n in lengths],
                           ["stop"] * 8, [i // 4 for i in range(8)])
    out = sort_by_length(result, 4)
    assert [len(t) for t in out.token_ids] == [9, 4, 3, 1, 8, 7, 5, 2]
    assert out.prompt_index == [0, 0, 0, 0, 1, 1, 1, 1]  # samples never cross optimizer batches
    assert [len(x) for x in out.logprobs] == [len(t) for t in out.token_ids]
