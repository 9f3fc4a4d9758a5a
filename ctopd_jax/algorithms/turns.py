"""Turns of a response (SPEC §9: TCOD, SOD and SAGE-OPD weight and pace by turn).

A response is a sequence of ASSISTANT TURNS. In a multi-turn episode (rollout/episodes.py) the
turns are the runs of student tokens between environment observations; in a single-turn task
they are the paragraphs of the response (split at blank lines, our extension, SPEC §9).

An `Episode` holds its response as segments: student segments (sampled tokens with their
rollout-time log-probs) and context segments (observations, replayed expert turns) that the
student reads but never trains on. `episode_arrays` flattens it into the token layout the host
batch uses: ids, a trained mask, log-probs and, per trained token, its turn index.

Decisions where SPEC is silent:
- Paragraph turns: a token opens a new turn when the text before its first non-whitespace
  character ends with a blank line ("\\n\\n", spaces and tabs ignored) and the token holds a
  non-whitespace character; whitespace-only tokens stay with the paragraph before them, so every token
  belongs to exactly one turn and turn indices never decrease.
- The closing EOS of a response belongs to its last turn.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

STUDENT, CONTEXT = "student", "context"


def paragraph_turns(token_texts: list[bytes]) -> np.ndarray:
    """Turn index of every token of a single-turn response (the paragraph it belongs to)."""
    turns = np.zeros(len(token_texts), np.int32)
    before = b""
    turn = 0
    for i, piece in enumerate(token_texts):
        lead = piece[:len(piece) - len(piece.lstrip())]   # "\n\nThe": the break is inside it
        if i and piece.strip() and (before + lead).replace(b" ", b"").replace(b"\t", b"").endswith(b"\n\n"):
            turn += 1
        turns[i] = turn
        before = (before + piece)[-64:]
    return turns


def paragraph_cut(token_texts: list[bytes], turns: int) -> int:
    """How many tokens make up the first `turns` paragraphs (TCOD F2B's k(n) turns)."""
    index = paragraph_turns(token_texts)
    return int(np.searchsorted(index, turns, side="left"))


@dataclass
class Segment:
    ids: list[int]
    role: str                          # STUDENT (trained) or CONTEXT (read, never trained)
    logprobs: list[float] | None = None   # rollout-time, per token; NaN where there is none


@dataclass
class Episode:
    """One sample: its prompt ids and the response as segments, with the environment's reward."""
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    reward: float = 0.0
    finish_reason: str = "stop"
    done: bool = False

    @property
    def response_len(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    @property
    def student_turns(self) -> int:
        return sum(1 for s in self.segments if s.role == STUDENT)

    def add(self, ids, role: str, logprobs=None) -> None:
        if len(ids):
            self.segments.append(Segment([int(t) for t in ids], role,
                                         None if logprobs is None else [float(x) for x in logprobs]))


class EpisodeTokens(NamedTuple):
    ids: np.ndarray        # int32 response tokens (student and context)
    trained: np.ndarray    # bool: a student token (in the loss)
    logprobs: np.ndarray   # float32 rollout-time log-prob (0 where unknown)
    known: np.ndarray      # bool: the engine gave that log-prob
    turn: np.ndarray       # int32 index of the student turn of the token (-1 on context)


def episode_arrays(episode: Episode) -> EpisodeTokens:
    """The episode's response as token arrays."""
    ids, trained, lps, known, turn = [], [], [], [], []
    k = -1
    for seg in episode.segments:
        student = seg.role == STUDENT
        k += student
        n = len(seg.ids)
        ids += seg.ids
        trained += [student] * n
        values = seg.logprobs if student and seg.logprobs is not None else [float("nan")] * n
        lps += [0.0 if np.isnan(v) else v for v in values]
        known += [not np.isnan(v) for v in values]
        turn += [k if student else -1] * n
    return EpisodeTokens(np.asarray(ids, np.int32), np.asarray(trained, bool), np.asarray(lps, np.float32),
                         np.asarray(known, bool), np.asarray(turn, np.int32))


@dataclass
class TurnRows:
    """Per-row and per-sample turn data of a collected batch (response rows in loss-mask order)."""
    turn: np.ndarray                   # int32 [rows]: the row's turn within its sample
    rewards: np.ndarray                # float32 [samples]: environment reward or grader score
    outcome: np.ndarray                # float32 [samples]: group-normalised outcome advantage
    judgment: np.ndarray | None = None  # float32 [rows]: a judge's weight i of the row's turn


def group_advantage(rewards: np.ndarray, group: int, eps: float = 1e-6) -> np.ndarray:
    """GRPO's outcome advantage: (r − mean) / (std + eps) over each prompt's `group` samples
    (prompt-major); 0 for a group of one."""
    r = np.asarray(rewards, np.float64).reshape(-1, group)
    if group == 1:
        return np.zeros(r.size, np.float32)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + eps)).reshape(-1).astype(np.float32)
