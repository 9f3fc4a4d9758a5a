"""A stand-in for a vLLM server of the student's rollouts (`rollout.engine: vllm_server`) that can
fault as the teacher's stand-in does (tests/teacher_service/_fake_teacher_server.py, its
`script` of actions, applied to every POST /v1/completions).

- POST /collective_rpc (reload_weights) loads the folder the client pushed (config.json and
  safetensors) and POST /reset_prefix_cache answers: both empty 200s, as vLLM's;
- POST /v1/completions with `prompt_logprobs` (the client's log-prob check after a push) answers
  the loaded weights' log-probs from this repository's plain forward (LocalTeacherScorer), as
  vLLM does from its own;
- POST /v1/completions for generation answers in the shape recorded from vLLM
  (recorded/vllm_generate.json): per prompt `n` samples of `max_tokens` ids taken from the
  prompt by the seed and the sample index alone (`sample_ids`), so a test knows them without
  the client, with the loaded weights' log-probs of them (a run that trains on them stays sane).
"""
from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "teacher_service"))
from _fake_teacher_server import FakeTeacherServer, Raw  # noqa: E402

RECORDED = Path(__file__).parent / "recorded" / "vllm_generate.json"


def sample_ids(prompt: list[int], seed: int, sample: int, length: int) -> list[int]:
    """A sample's token ids: characters of its prompt picked by the seed and the sample index."""
    return [prompt[(seed + 3 * sample + 5 * t) % len(prompt)] for t in range(length)]


class RolloutStandIn(FakeTeacherServer):
    def __init__(self, vocab: int):
        self.vocab = vocab
        self.scorer = None   # the pushed weights' forward, once a push came
        self.pushed: list[str] = []
        self.choice = json.loads(RECORDED.read_text())["answer"]["choices"][0]
        super().__init__("vllm", self, model="student")

    def route(self, method: str, path: str, body: dict | None):
        if method == "POST" and path == "/collective_rpc":
            self.load(body["kwargs"]["weights_path"])
            return 200, Raw(b"")
        if method == "POST" and path == "/reset_prefix_cache":
            return 200, Raw(b"")
        return super().route(method, path, body)

    def load(self, folder: str):
        from ctopd_jax.models.weights import load_hf_checkpoint
        from ctopd_jax.teacher_service.local_scores import LocalTeacherScorer

        model, _ = load_hf_checkpoint(Path(folder), dtype="float32")
        self.scorer = LocalTeacherScorer(model, top_k=1, batch_bucket=8)
        self.pushed.append(folder)

    def token_logprobs(self, prompt: list[int], responses: list[list[int]]) -> list[list[float]]:
        scored = self.scorer.score([prompt + ids for ids in responses], [len(prompt)] * len(responses))
        return [s.token_logprobs.astype(np.float64).tolist() for s in scored]

    def vllm_completions(self, body):
        if "prompt_logprobs" in body:   # the log-prob check: vLLM's prompt_logprobs rows
            choices = []
            for index, ids in enumerate(body["prompt"]):
                values = self.token_logprobs(ids[:1], [ids[1:]])[0]
                rows = [None] + [{str(t): {"logprob": v, "rank": 1, "decoded_token": f"<{t}>"}}
                                 for t, v in zip(ids[1:], values)]
                choices.append({"index": index, "text": "x", "logprobs": None,
                                "finish_reason": "length", "prompt_logprobs": rows})
            return 200, {"id": "cmpl-check", "object": "text_completion", "model": self.model,
                         "choices": choices}
        (prompt,) = body["prompt"]
        responses = [sample_ids(prompt, body["seed"], j, body["max_tokens"])
                     for j in range(body["n"])]
        choices = []
        for index, (ids, values) in enumerate(zip(responses,
                                                  self.token_logprobs(prompt, responses))):
            choice = copy.deepcopy(self.choice)
            choice.update(index=index, finish_reason="length", stop_reason=None, token_ids=ids,
                          prompt_token_ids=prompt)
            choice["logprobs"].update(text_offset=list(range(len(ids))), token_logprobs=values,
                                      tokens=[f"token_id:{t}" for t in ids],
                                      top_logprobs=[{f"token_id:{t}": v}
                                                    for t, v in zip(ids, values)])
            choices.append(choice)
        return 200, {"id": "cmpl-stand-in", "object": "text_completion", "model": self.model,
                     "choices": choices}

    def shorten(self, payload):
        """One log-prob too few: the first sample's last token has none."""
        choice = payload["choices"][0]
        if choice.get("prompt_logprobs"):
            choice["prompt_logprobs"].pop()
        else:
            choice["logprobs"]["token_logprobs"].pop()
