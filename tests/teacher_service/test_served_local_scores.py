"""The local teacher's ScoredSequences (the reference the real-server test and the benchmark use)
equal an HF transformers forward of the demo teacher."""
import numpy as np
import torch
from transformers import AutoModelForCausalLM

from ctopd_jax.models.weights import load_hf_checkpoint
from ctopd_jax.demo.served_inputs import DEMO_TEACHER, demo_teacher_inputs
from ctopd_jax.teacher_service.local_scores import LocalTeacherScorer


def test_local_scores_equal_hf_forward():
    sequences, starts = demo_teacher_inputs(6, seed=3)
    assert all(s[-1] == 799 for s in sequences) and all(0 < st < len(s) - 2
                                                        for s, st in zip(sequences, starts))
    model, _ = load_hf_checkpoint(DEMO_TEACHER)
    scored = LocalTeacherScorer(model, top_k=8, length_bucket=16, batch_bucket=4).score(
        sequences, starts)
    hf = AutoModelForCausalLM.from_pretrained(DEMO_TEACHER, dtype=torch.float32).eval()
    for got, ids, start in zip(scored, sequences, starts):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].double()
        lp = torch.log_softmax(logits, -1).numpy()[start - 1:len(ids) - 1]
        np.testing.assert_allclose(got.token_logprobs,
                                   lp[np.arange(len(lp)), ids[start:]], atol=2e-4)
        np.testing.assert_allclose(got.topk_logprobs, -np.sort(-lp, axis=1)[:, :8], atol=2e-4)
        np.testing.assert_allclose(np.take_along_axis(lp, got.topk_ids, 1), got.topk_logprobs,
                                   atol=2e-4)
