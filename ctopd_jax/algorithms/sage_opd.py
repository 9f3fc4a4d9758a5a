"""SAGE-OPD (SPEC §9): teacher-judged turn weights on the full-vocabulary KL.
`algorithm.name: sage_opd`.

Per student turn the judge says Skip / Weak / Strong → i ∈ {0, α, 1}; the confidence c is the
teacher's top-1 probability averaged over the turn's tokens; s = i·c. The weights are rescaled
to mean 1 over the micro-batch's response tokens (so the loss keeps OPD's scale) and the loss is
Σ_t w_t·KL(π_θ‖π_T)_t over the full vocabulary (÷ tokens, SPEC §1).

The paper has no released code; ours, documented:
- α = `sage_alpha` 0.5; the judgment of a turn comes after the environment's feedback on it
  (when there is one) and is shown in JUDGE_PROMPT; the teacher answers greedily through the
  rollout engine (`sage_judge: teacher`, at most `sage_judge_tokens` tokens).
- Parsing: the words skip / weak / strong (any case, whole words) in the answer; exactly one
  distinct label → it; none, or several different ones ("not Strong but Weak") → unparseable,
  which counts as Strong (the turn keeps full distillation).
- `sage_judge: proxy` (labelled as such in the metrics, `sage_proxy_judge` 1) for models too
  small to judge: top-1 agreement of student and teacher over the turn > `sage_proxy_skip_above`
  (0.8) → Skip, > 0 → Weak, else Strong. 1.0 never skips (agreement cannot exceed 1).
- The mean-1 rescaling is per micro-batch (the optimizer batch when micro_batch_size equals
  train_batch_size); a micro-batch judged all Skip trains nothing.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from ctopd_jax.algorithms.base import Needs, TurnJudge, register
from ctopd_jax.algorithms.same_tokenizer import SameTokenizerSettings, full_vocab_sum
from ctopd_jax.algorithms.turn_based import TurnObjective, segment_means
from ctopd_jax.algorithms.turns import STUDENT, episode_arrays
from ctopd_jax.config import require
from ctopd_jax.kernels.full_rows import row_stats, top1_stats

JUDGE_PROMPT = (
    "You are checking one step of a student's work.\n"
    "Task: {task}\n"
    "Student step: {step}\n"
    "Feedback after the step: {feedback}\n"
    "How much does this step need the teacher's correction? Answer with one word: "
    "Skip (the step is right), Weak (it has minor problems) or Strong (it is wrong).")
LABELS = ("skip", "weak", "strong")
_LABEL_RE = re.compile(r"\b(skip|weak|strong)\b", re.IGNORECASE)


def parse_judgment(text: str) -> str:
    """'skip' | 'weak' | 'strong'; unparseable answers count as 'strong' (see the module doc)."""
    found = {m.lower() for m in _LABEL_RE.findall(text or "")}
    return found.pop() if len(found) == 1 else "strong"


@dataclass(frozen=True)
class SageSettings(SameTokenizerSettings):
    sage_judge: Literal["teacher", "proxy"] = "teacher"  # who judges a turn Skip/Weak/Strong
    sage_alpha: float = 0.5              # the weight of a Weak turn
    sage_judge_tokens: int = 8           # the teacher judge writes at most this many tokens
    sage_proxy_skip_above: float = 0.8   # the proxy judge's Skip threshold on top-1 agreement

    def validate(self) -> None:
        super().validate()
        require(0.0 <= self.sage_alpha <= 1.0, "algorithm.sage_alpha", f"{self.sage_alpha} must be in [0, 1]")
        require(self.sage_judge_tokens >= 1, "algorithm.sage_judge_tokens",
                 f"{self.sage_judge_tokens} must be >= 1")
        require(0.0 <= self.sage_proxy_skip_above <= 1.0, "algorithm.sage_proxy_skip_above",
                 f"{self.sage_proxy_skip_above} must be in [0, 1]")


@register("sage_opd")
class SageOpd(TurnObjective, TurnJudge):
    settings_class = SageSettings
    response_logprob_grad = False
    stale_responses = "none"   # weighted full-vocabulary KL per state
    # the demo's tiny teacher cannot read a judge prompt: the demo judges with the labelled proxy
    demo_settings = {"algorithm.sage_judge": "proxy"}
    # cannot pack: the weights are rescaled to mean 1 over each micro-batch, so a token budget
    # (other micro-batch boundaries) would change the loss, not only its layout
    packs = False

    @property
    def needs(self) -> Needs:   # a teacher judge samples through an engine of its own
        return Needs(responses="student", teacher=True, rollout_logprobs=False, reuse_sampled_ids=True,
                     turns=True, episodes=True, teacher_engine=self.settings.sage_judge == "teacher")

    def judgment_weight(self, label: str) -> float:
        return {"skip": 0.0, "weak": self.settings.sage_alpha, "strong": 1.0}[label]

    def check_models(self, config, teacher_cfg, teacher_side) -> None:
        """The teacher judge reads a whole turn and its feedback inside a template: the longest
        judge call (prompt, the episode so far, the template, the judged turn) must fit the
        teacher's positions."""
        if self.settings.sage_judge != "teacher":
            return
        r = config.rollout
        longest = (r.max_prompt_len + r.generate_max_len + self.judge_prompt_tokens(teacher_side, r)
                   + r.generate_max_len)
        if longest > teacher_cfg.max_position_embeddings:
            raise ValueError(f"algorithm.sage_judge=teacher: a judge call needs up to {longest} "
                             f"positions but the teacher's max_position_embeddings is "
                             f"{teacher_cfg.max_position_embeddings}; use sage_judge=proxy for a "
                             "small model, or shorter rollout.max_prompt_len / generate_max_len")

    def judge_prompt_tokens(self, side, rollout) -> int:
        """The judge template around a turn (≤ the response budget) and its feedback (too)."""
        if self.settings.sage_judge != "teacher":
            return 0
        empty = JUDGE_PROMPT.format(task="", step="", feedback="(none)")
        return len(side.encode(side.render_chat([{"role": "user", "content": empty}]))) + rollout.generate_max_len

    def annotate(self, turns, episodes, samples, collector) -> None:
        """The teacher judges every student turn (one batched greedy generate call)."""
        if self.settings.sage_judge != "teacher":
            return
        side, prompts, where = collector.side, [], []
        for b, ep in enumerate(episodes):
            segs = ep.segments
            for k, seg in enumerate(segs):
                if seg.role != STUDENT:
                    continue
                feedback = segs[k + 1] if k + 1 < len(segs) and segs[k + 1].role != STUDENT else None
                text = JUDGE_PROMPT.format(task=samples[b].text, step=side.decode(seg.ids),
                                           feedback=side.decode(feedback.ids) if feedback else "(none)")
                prompts.append(side.encode(side.render_chat([{"role": "user", "content": text}])))
                where.append(b)
        params = collector.judge_params(self.settings.sage_judge_tokens)
        result = collector.teacher_engine.generate(prompts, params)
        labels = [parse_judgment(side.decode(ids)) for ids in result.token_ids]
        collector.note("sage_judge_labels", labels)
        per_row, j = [], 0
        for ep in episodes:
            tokens = episode_arrays(ep)
            n = ep.student_turns
            weights = np.array([self.judgment_weight(x) for x in labels[j:j + n]], np.float32)
            j += n
            per_row.append(weights[tokens.turn[tokens.trained]])
        turns.judgment = np.concatenate(per_row)

    def kd_weights(self):
        return {"sage_opd": 1.0}

    def kd_sums(self, x):
        s = self.settings
        rw = x.batch.response_weight
        seg = x.batch.terms.turn_segment
        rows = jnp.take(x.hidden, x.batch.response_rows, axis=0)
        stats = row_stats(top1_stats, ((rows, x.lm_head), (x.teacher_hidden, x.teacher_lm_head)),
                          temperature=s.kd_temperature, chunk_rows=s.chunked_loss_size)
        confidence = segment_means(stats[:, 0], x)[seg]
        if s.sage_judge == "proxy":
            agree = segment_means(stats[:, 1], x)[seg]
            judged = jnp.where(agree > s.sage_proxy_skip_above, 0.0, jnp.where(agree > 0.0, s.sage_alpha, 1.0))
        else:
            judged = x.batch.terms.turn_judgment
        score = jax.lax.stop_gradient(judged * confidence)
        mean = jnp.sum(rw * score) / jnp.maximum(jnp.sum(rw), 1.0)
        weight = jnp.where(mean > 0, score / jnp.maximum(mean, 1e-12), 0.0) * rw
        total, _ = full_vocab_sum(x, s, "rkl", s.kd_temperature, weights=weight)
        count = jnp.sum(rw)
        metrics = {"sage_confidence": (jnp.sum(rw * confidence), count),
                   "sage_skip_fraction": (jnp.sum(rw * (judged == 0.0)), count),
                   "sage_strong_fraction": (jnp.sum(rw * (judged == 1.0)), count),
                   "sage_proxy_judge": (jnp.float32(s.sage_judge == "proxy") * count, count)}
        return {"sage_opd": total}, metrics
