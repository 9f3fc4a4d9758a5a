"""Chat rendering against transformers' apply_chat_template, and loading errors."""
import json
import shutil

import pytest
from _hf_ref import hf_reference

from ctopd_jax.tokenization import (ChatTemplateError, TokenizerLoadError, load_tokenizer_side,
                                    render_chat)
from ctopd_jax.tokenization.byte_view import detect_kind

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 plus 7?"}],
    [{"role": "system", "content": "Please reason step by step, and put your final answer "
                                   "within \\boxed{}."},
     {"role": "user", "content": "  Compute 7 + 5 - 3.\n"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! é 😀"},
     {"role": "user", "content": "2*3=?"}],
]


@pytest.mark.parametrize("name", ["tiny_bpe", "tiny_unigram", "qwen", "llama"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_chat_rendering_matches_transformers(name, conversation, request):
    side = request.getfixturevalue(name)
    reference = hf_reference(str(side.path))
    messages = CONVERSATIONS[conversation]
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert side.render_chat(messages) == want
    assert side.eos_id == reference.convert_tokens_to_ids(reference.eos_token)


def test_real_chat_layouts(qwen, llama):
    prompt = [{"role": "user", "content": "1+1?"}]
    assert qwen.render_chat(prompt) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert llama.render_chat(prompt) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n1+1?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert qwen.tokenizer.id_to_token(qwen.eos_id) == "<|im_end|>"
    assert llama.tokenizer.id_to_token(llama.eos_id) == "<|eot_id|>"


def test_encode_decode_match_transformers(qwen, llama):
    text = "Let x = 3/4. Then 2x + 1 = 2.5, so \\boxed{2.5}. Ünïcödé 数学 😀\n\n"
    for side in (qwen, llama):
        reference = hf_reference(str(side.path))
        ids = side.encode(text)
        assert ids == reference(text, add_special_tokens=False)["input_ids"]
        assert side.decode(ids) == reference.decode(ids, skip_special_tokens=True) == text


def test_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="chat_template"):
        render_chat(None, [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="raised: no system"):
        render_chat("{{ raise_exception('no system') }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="messages"):
        render_chat("{{ messages }}", [{"content": "x"}])


def test_missing_and_unreadable_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_tokenizer_side(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        load_tokenizer_side(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerLoadError, match="cannot read"):
        load_tokenizer_side(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nonsense"}}))
    with pytest.raises(TokenizerLoadError, match="not a valid tokenizer"):
        load_tokenizer_side(tmp_path)


def test_missing_eos_and_unknown_eos(tmp_path, tiny_bpe):
    shutil.copy(tiny_bpe.path / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "x"}))
    with pytest.raises(TokenizerLoadError, match="eos_token"):
        load_tokenizer_side(tmp_path)
    side = load_tokenizer_side(tmp_path, eos_token="<|endoftext|>")
    assert side.eos_id == side.pad_id == tiny_bpe.tokenizer.token_to_id("<|endoftext|>")
    with pytest.raises(TokenizerLoadError, match="not in the vocabulary"):
        load_tokenizer_side(tmp_path, eos_token="<nope>")


def test_unsupported_kind_is_named():
    spec = {"pre_tokenizer": {"type": "BertPreTokenizer"}, "decoder": {"type": "WordPiece"},
            "model": {"type": "WordPiece"}}
    with pytest.raises(ValueError, match="supported are ByteLevel"):
        detect_kind(spec)


def test_unknown_name_lists_choices():
    with pytest.raises(FileNotFoundError, match="tiny_bpe, tiny_unigram, qwen2.5, llama3"):
        load_tokenizer_side("qwen9")
