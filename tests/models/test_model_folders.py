"""Model folders as users have them (issue 43): each loads as transformers loads it (logits
within 1e-4 of transformers' float32 forward over the same files) or is refused in one line
before any weight is read.

- fp16 and bf16 safetensors, sharded with model.safetensors.index.json, tied and untied heads;
- an embedding with more rows than the tokenizer has tokens (Qwen2.5: 151,936 rows for 151,665
  tokens): loads, and the sampler never draws the extra rows;
- a config.json of another architecture, and a tokenizer without a chat template: one line
  naming the file and what to do.
"""
import json
import shutil

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_fixtures import VARIANTS, hf_logits, hf_model, jax_logits
from ctopd_jax.config import load_config
from ctopd_jax.models import weights
from ctopd_jax.models.config import tiny_llama
from ctopd_jax.preflight import PreflightError, check_hf_checkpoint
from ctopd_jax.preflight.tokenizers import load_tokenizer
from ctopd_jax.rollout.base import SamplingParams
from ctopd_jax.rollout.jax_sampler import JaxSampler
from ctopd_jax.tokenization.chat import ChatTemplateError
from ctopd_jax.tokenization.side import cached_tokenizer_side, load_tokenizer_side

IDS = np.random.RandomState(0).randint(0, 256, (2, 11))
TORCH = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# both dtypes, both families, a tied and an untied head in two cases
@pytest.mark.parametrize("stored,variant", [("float16", "llama_untied_llama3rope"),
                                            ("bfloat16", "qwen2_tied_bias")])
def test_half_precision_sharded_folders_load_as_transformers_reads_them(tmp_path, variant, stored):
    hf_model(VARIANTS[variant]()).to(TORCH[stored]).save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1            # sharded, with its index
    check_hf_checkpoint(tmp_path, "model.student")               # headers only
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model, cfg = weights.load_hf_checkpoint(tmp_path)            # float32 compute over the same values
    assert cfg.tie_word_embeddings == VARIANTS[variant]().tie_word_embeddings
    np.testing.assert_allclose(jax_logits(model, IDS), hf_logits(reference, IDS), atol=1e-4)


@pytest.fixture(scope="module")
def padded_folder(tmp_path_factory):
    """A Llama folder whose embedding has 7 rows more than its tokenizer (tiny_unigram) has
    tokens, with that tokenizer beside the weights, as Qwen2.5's folders are."""
    folder = tmp_path_factory.mktemp("padded")
    tokenizer = cached_tokenizer_side("tiny_unigram")
    cfg = tiny_llama(vocab_size=tokenizer.vocab_size + 7)
    hf = hf_model(cfg)
    hf.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer.path / name, folder / name)
    return folder, hf, tokenizer.vocab_size


@pytest.mark.slow   # the sampler's programs compile (~25 s on 2 cores); sampling.py's own
# test (tests/rollout/test_sampling.py) keeps the cut in the default suite
def test_an_embedding_padded_past_its_tokenizer_loads_and_its_rows_are_never_sampled(padded_folder):
    folder, hf, tokens = padded_folder
    cfg = check_hf_checkpoint(folder, "model.student")
    assert cfg.vocab_size == tokens + 7
    config = load_config(None, ["model.student=" + str(folder), "model.student_tokenizer="])
    side = load_tokenizer(config, "student", folder, cfg)        # more rows than tokens: accepted
    assert side.vocab_size == tokens
    model, _ = weights.load_hf_checkpoint(folder)
    np.testing.assert_allclose(jax_logits(model, IDS), hf_logits(hf, IDS), atol=1e-4)
    # nearly flat sampling (temperature 50) over 160 draws: without the limit the 7 extra rows
    # come up (the check can fail), with the tokenizer's size as the limit never
    prompts = [list(IDS[0][:5 + i]) for i in range(5)]
    params = SamplingParams(temperature=50.0, max_new_tokens=8, n=4, seed=0)
    loose = JaxSampler(model, eos_ids=None, pad_id=0).generate(prompts, params)
    assert max(max(t) for t in loose.token_ids) >= tokens
    limited = JaxSampler.from_config(model, side, config.rollout)
    assert limited.vocab_limit == tokens
    drawn = limited.generate(prompts, params)
    assert max(max(t) for t in drawn.token_ids) < tokens
    greedy = limited.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8))
    assert max(max(t) for t in greedy.token_ids) < tokens


def test_another_architecture_is_refused_in_one_line_before_any_weight(tmp_path):
    hf_model(VARIANTS["llama_tied"]()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"not read")    # a read would fail otherwise
    with pytest.raises(PreflightError) as err:
        check_hf_checkpoint(tmp_path, "model.teacher")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"model.teacher: {tmp_path / 'config.json'}")
    assert "'mistral'" in line and "llama" in line and "qwen2" in line, line


def test_a_tokenizer_without_a_chat_template_is_one_line_naming_the_file(tmp_path):
    source = cached_tokenizer_side("tiny_unigram").path
    shutil.copy(source / "tokenizer.json", tmp_path / "tokenizer.json")
    settings = json.loads((source / "tokenizer_config.json").read_text())
    settings.pop("chat_template")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    side = load_tokenizer_side(str(tmp_path))
    with pytest.raises(ChatTemplateError) as err:
        side.render_prompt("What is 1 + 1?")
    line = str(err.value)
    assert "\n" not in line and str(tmp_path / "tokenizer_config.json") in line, line
    assert "chat_template.jinja" in line


def test_special_and_added_tokens_of_a_chat_template_encode_as_their_own_ids(qwen):
    """Qwen2.5's template writes <|im_start|> / <|im_end|> (added, special tokens): the rendered
    prompt encodes each as its one id, never as the bytes of its text."""
    text = qwen.render_prompt("What is 1 + 1?")
    ids = qwen.encode(text)
    start, end = (qwen.tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>"))
    assert start in qwen.special_ids and end in qwen.special_ids
    assert ids.count(start) == text.count("<|im_start|>") >= 2
    assert ids.count(end) == text.count("<|im_end|>") >= 1
    assert qwen.decode(ids, skip_special_tokens=False) == text
