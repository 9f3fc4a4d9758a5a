"""A rollout engine that answers from a script (rollout.base.RolloutEngine's face), for tests
that need chosen responses without sampling: the episode tests' turns (texts) and the packing
tests' long-tail responses (token ids of chosen lengths)."""
from __future__ import annotations

import numpy as np

from ctopd_jax.rollout.base import RolloutResult

EOS = "<|end|>"


class ScriptedEngine:
    """Answers call c, active sample j with script[j][c]: a text (EOS written as <|end|>) or a
    list of token ids; log-prob of the i-th token of an answer: `logprob`, or -(i + 1) / 100
    without it. A sample whose script has no call c left is not active. Records the contexts
    it was given."""

    def __init__(self, side, script, logprob: float | None = None):
        self.side, self.script, self.logprob, self.calls = side, script, logprob, []
        self.eos_ids = (side.eos_id,)
        self.pad_id = side.pad_id

    def ids(self, answer) -> list[int]:
        if not isinstance(answer, str):
            return [int(t) for t in answer]
        body = answer.replace(EOS, "")
        return self.side.encode(body) + ([self.side.eos_id] if answer.endswith(EOS) else [])

    def generate(self, prompts, params):
        """One answer per sample, prompt-major (`params.n` samples per prompt)."""
        self.calls.append([list(p) for p in prompts])
        c = len(self.calls) - 1
        active = [j for j, turns in enumerate(self.script) if len(turns) > c][:len(prompts) * params.n]
        toks = [self.ids(self.script[j][c])[:params.max_new_tokens] for j in active]
        logprobs = [[-(i + 1) / 100 if self.logprob is None else self.logprob for i in range(len(t))] for t in toks]
        return RolloutResult([list(p) for p in prompts], toks, logprobs, ["stop"] * len(toks),
                             [k // params.n for k in range(len(toks))])

    def update_weights(self, model):
        pass


def long_tail_engine(side, rng, n: int, longest: int, break_every: int = 256) -> ScriptedEngine:
    """A uniform sampler's answers for `n` samples (each token's log-prob: -log of the number
    of tokens it draws from): lengths log-uniform over 8..`longest` (the first two exactly 8
    and `longest`, so the spread is always covered) with the EOS last; the text of random ids
    of the side's own tokens (not added, whole UTF-8 characters: a replacement character fails
    MP-OPD's atoms closed) with a blank line about every `break_every` tokens (paragraph
    turns), as the side tokenizes it, so that re-tokenizing the response keeps its length
    about."""
    plain = [i for i in np.flatnonzero(~np.asarray(side.is_added)) if whole_characters(side.token_bytes[i])]
    lengths = [8, longest] + list(np.exp(rng.uniform(np.log(8), np.log(longest), n - 2)).astype(int))
    script = []
    for length in lengths[:n]:
        pieces = [side.decode(rng.choice(plain, min(break_every, length))) for _ in range(0, length, break_every)]
        script.append([side.encode("\n\n".join(pieces))[:length - 1] + [side.eos_id]])
    return ScriptedEngine(side, script, logprob=-float(np.log(len(plain))))


def whole_characters(piece: bytes) -> bool:
    try:
        return bool(piece.decode("utf-8"))
    except UnicodeDecodeError:
        return False
