"""Both-side re-tokenization (SPEC §1.3) against a reference built on transformers."""
import numpy as np
import pytest
from _hf_ref import hf_reference as hf

from ctopd_jax.tokenization import IGNORE_INDEX, retokenize, retokenize_pair

RESPONSES = ["7 + 5 = 12. 12 - 3 = 9. The answer is 9.", "Answer: 19", "",
             "x" * 3 + " é😀 \\boxed{4}", "truncated mid-wor"]


def reference(side, prompts, responses):
    """SPEC §1.3 with transformers: full + [eos], prompt_len = len(full) - len(resp)."""
    tok = hf(str(side.path))
    rows = []
    for prompt, response in zip(prompts, responses):
        resp = tok(response, add_special_tokens=False)["input_ids"]
        full = tok(prompt + response, add_special_tokens=False)["input_ids"]
        rows.append((full + [side.eos_id], len(full) - len(resp), len(resp) + 1))
    return rows


@pytest.mark.parametrize("name", ["tiny_bpe", "qwen", "llama"])
def test_matches_reference(name, request):
    side = request.getfixturevalue(name)
    prompts = [side.render_prompt(f"Compute {i} + 1.") for i in range(len(RESPONSES))]
    batch = retokenize(side, prompts, RESPONSES, pad_to_multiple=8)
    assert batch.input_ids.dtype == np.int32 and batch.seq_len % 8 == 0
    for b, (ids, plen, rlen) in enumerate(reference(side, prompts, RESPONSES)):
        assert batch.input_ids[b, :len(ids)].tolist() == ids
        assert (batch.input_ids[b, len(ids):] == side.pad_id).all()
        assert batch.prompt_lens[b] == plen and batch.response_lens[b] == rlen
        rows = np.flatnonzero(batch.loss_mask[b])
        # the rows predicting the response tokens and the EOS: row p predicts ids[p + 1]
        assert rows.tolist() == list(range(plen - 1, plen - 1 + rlen))
        assert batch.labels[b, rows].tolist() == ids[plen:]
        assert (batch.labels[b][~batch.loss_mask[b]] == IGNORE_INDEX).all()
        assert batch.attention_mask[b].sum() == len(ids)
    assert batch.num_response_tokens == sum(len(r) for r in
                                            [side.encode(x) for x in RESPONSES]) + len(RESPONSES)


def test_dummy_prefix_does_not_move_the_boundary(tiny_unigram):
    """SentencePiece puts a '▁' before a response encoded alone, which changes its segmentation;
    the prompt/response boundary must stay where the text puts it (retokenize._prompt_len)."""
    prompt = tiny_unigram.render_prompt("Compute 1 + 2.")
    batch = retokenize(tiny_unigram, [prompt, prompt], ["Question: 1", " 3"])
    assert batch.resp_bytes == [b"Question: 1", b" 3"]
    prompt_ids = tiny_unigram.encode(prompt)
    assert batch.input_ids[0, :len(prompt_ids)].tolist() == prompt_ids
    assert batch.prompt_lens.tolist() == [len(prompt_ids)] * 2


def test_pair_uses_each_sides_prompt_and_eos(tiny_bpe, tiny_unigram):
    t, s = retokenize_pair(tiny_bpe, tiny_unigram, [tiny_bpe.render_prompt("q")],
                           [tiny_unigram.render_prompt("q")], ["1 + 1 = 2"])
    assert t.input_ids[0, t.prompt_lens[0] + t.response_lens[0] - 1] == tiny_bpe.eos_id
    assert s.input_ids[0, s.prompt_lens[0] + s.response_lens[0] - 1] == tiny_unigram.eos_id
    assert t.resp_bytes == s.resp_bytes == [b"1 + 1 = 2"]


def test_bad_inputs(tiny_bpe):
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        retokenize(tiny_bpe, ["a", "b"], ["x"])
    with pytest.raises(ValueError, match="empty"):
        retokenize(tiny_bpe, [], [])
    with pytest.raises(TypeError, match=r"responses\[0\]"):
        retokenize(tiny_bpe, ["a"], [None])
    with pytest.raises(ValueError, match="max_length"):
        retokenize(tiny_bpe, ["<|im_start|>"], ["1 2 3 4 5 6"], max_length=4)
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        retokenize(tiny_bpe, [""], ["7"])
    with pytest.raises(ValueError, match="pad_to_multiple"):
        retokenize(tiny_bpe, ["a"], ["b"], pad_to_multiple=0)
