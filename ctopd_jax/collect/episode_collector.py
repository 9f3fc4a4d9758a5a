"""Host collection of episodes: the turn-structured objectives (tcod, sod, sage_opd; SPEC §9),
and any student-sampled same-tokenizer objective (opd, opd_full, vopd, opd2) when
`rollout.environment` is set.

`EpisodeCollector.collect` expands the prompts n times (prompt-major), asks the objective for
its curriculum (TCOD: the turn limit, the expert prefix), plays the episodes with the student
engine (rollout/episodes.py; with `rollout.environment` when set), lets the objective add its
host-side labels (SAGE-OPD's judge) and lays the result out as a same-tokenizer HostBatch:
observation and replayed tokens are context, only the student's own tokens are trained.

Decisions where SPEC is silent:
- Rewards: the environment's (summed over the episode); without an environment, the answer
  grader's (1 if the response's answer equals the row's `answer`, MATH rules with the
  "The answer is X" fallback), computed only when an objective uses them.
- Expert paths (B2F) come from the row: `expert_turns` (texts), `expert_actions` (an
  environment's action list) or, without an environment, the `response` split into paragraphs;
  a row without any gets a greedy teacher episode (ours).
"""
from __future__ import annotations

import numpy as np

from ctopd_jax.algorithms.base import TurnCurriculum, TurnJudge
from ctopd_jax.algorithms.turns import STUDENT, TurnRows, episode_arrays, group_advantage
from ctopd_jax.collect.collector import HostBatch, identity_alignment, render, sampling_params, token_batch
from ctopd_jax.grading.grader import MathGrader
from ctopd_jax.rollout.episodes import play


def expert_path(prompt, has_environment: bool) -> list[str] | None:
    for key in ("expert_turns", "expert_actions"):
        value = prompt.extra.get(key)
        if isinstance(value, (list, tuple)) and value:
            return [str(v) for v in value]
    response = prompt.extra.get("response")
    if not has_environment and isinstance(response, str) and response.strip():
        return [p.strip() for p in response.split("\n\n") if p.strip()]
    return None


class EpisodeCollector:
    def __init__(self, side, engine, rollout_section, objective, *, environment=None, teacher_engine=None):
        """`environment`: a factory of envs.Environment (None: single-turn paragraph turns)."""
        self.side, self.engine, self.rollout, self.objective = side, engine, rollout_section, objective
        self.environment, self.teacher_engine = environment, teacher_engine
        self.notes: dict = {}

    def note(self, key, value) -> None:
        """Keep a host-side record of the last collection (judge labels...) for inspection."""
        self.notes[key] = value

    def judge_params(self, max_new_tokens: int):
        return sampling_params(self.rollout, 0).replace(temperature=0.0, n=1, max_new_tokens=max_new_tokens)

    def _play(self, engine, samples, encoded, params, **plan):
        r = self.rollout
        return play(engine, self.side, samples, encoded, params, environment=self.environment,
                    max_turns=r.max_turns, step_timeout_s=r.step_timeout_s, **plan)

    def _experts(self, samples, encoded, seed) -> list[list[str]]:
        paths = [expert_path(p, self.environment is not None) for p in samples]
        missing = [b for b, x in enumerate(paths) if x is None]
        if missing:   # a greedy teacher episode is the expert path (ours)
            if self.teacher_engine is None:
                raise ValueError(f"{samples[missing[0]].source}: no expert path (expert_turns, expert_actions or "
                                 "response) and no teacher engine to play one")
            params = sampling_params(self.rollout, seed).replace(n=1, temperature=0.0)
            played = self._play(self.teacher_engine, [samples[b] for b in missing],
                                [encoded[b] for b in missing], params)
            for b, ep in zip(missing, played):
                turns = [self.side.decode(s.ids) for s in ep.segments if s.role == STUDENT]
                paths[b] = [t for t in turns if t.strip()] or [""]
        self.note("teacher_expert_samples", len(missing))
        return paths

    def rewards(self, samples, episodes) -> np.ndarray:
        if self.environment is not None:
            return np.array([ep.reward for ep in episodes], np.float32)
        texts = [self.side.decode([t for s in ep.segments if s.role == STUDENT for t in s.ids]) for ep in episodes]
        golds = [str(p.extra.get("answer", "")) for p in samples]
        with MathGrader() as grader:
            graded = grader.grade_many(texts, golds, True)
        return np.array([float(g.correct) if gold else 0.0 for g, gold in zip(graded, golds)], np.float32)

    def collect(self, prompts, seed: int, timer, rollout_index: int = 0) -> HostBatch:
        n = self.rollout.n_samples_per_prompt
        samples = [p for p in prompts for _ in range(n)]
        encoded = [self.side.encode(render(self.side, p)) for p in samples]
        obj = self.objective
        # a curriculum's turn limit and expert prefix; other objectives (opd, ...) have none
        curriculum = obj if isinstance(obj, TurnCurriculum) else None
        plan = {"turn_limit": curriculum.turn_limit(rollout_index) if curriculum else None}
        uses_expert = curriculum is not None and curriculum.uses_expert()
        with timer("rollout"):
            if uses_expert:
                paths = self._experts(samples, encoded, seed)
                plan["expert_turns"] = [x[:curriculum.expert_prefix(rollout_index, len(x))] for x in paths]
            params = sampling_params(self.rollout, seed).replace(n=1)
            episodes = self._play(self.engine, samples, encoded, params, **plan)
        with timer("align"):
            laid = [episode_arrays(ep) for ep in episodes]
            batch = token_batch(self.side, encoded, [a.ids for a in laid], [a.trained for a in laid])
            values = np.concatenate([a.logprobs[a.trained] for a in laid])
            weights = np.concatenate([a.known[a.trained] for a in laid]).astype(np.float32)
            uses_rewards = self.environment is not None or (obj.needs.outcome_rewards and n > 1)
            rewards = self.rewards(samples, episodes) if uses_rewards else np.zeros(len(samples), np.float32)
            turns = TurnRows(turn=np.concatenate([a.turn[a.trained] for a in laid]), rewards=rewards,
                             outcome=group_advantage(rewards, n))
            if isinstance(obj, TurnJudge):
                obj.annotate(turns, episodes, samples, self)
        stats = {"reward": float(rewards.mean()) if uses_rewards else None,
                 "student_turns": float(np.mean([ep.student_turns for ep in episodes])),
                 "turn_limit": plan["turn_limit"],
                 "expert_prefix_turns": float(np.mean([len(x) for x in plan["expert_turns"]]))
                 if "expert_turns" in plan else None,
                 "teacher_expert_samples": self.notes.get("teacher_expert_samples") if uses_expert else None}
        return HostBatch(batch, batch, identity_alignment(batch), (values, weights),
                         [self.side.decode(a.ids) for a in laid], [ep.finish_reason for ep in episodes],
                         turns=turns, turn_stats=stats)
