"""Turn-structured rollouts with any engine (JAX sampler or vLLM): `play` returns one
`turns.Episode` per sample.

With an environment (envs/): reset → [the student writes a turn; the environment answers;
the observation joins the context] until the environment says done, the turn cap, or the token
budget. A turn ends at the EOS or right after the environment's `tool_stop` text ("</calc>").
Without one (a single-turn task), the student writes one response, split into paragraph turns.

TCOD's curricula enter as two arguments: `turn_limit` (F2B: the student plays at most k(n)
turns) and `expert_turns` (B2F: expert turns replayed as context before the student starts).

Decisions where SPEC is silent:
- The engines stop only at EOS (vLLM runs without detokenization, so it has no stop strings);
  the driver cuts a turn right after the first `tool_stop` in its text and discards what was
  sampled after it. Causal sampling makes the kept tokens and their log-probs exactly what a
  stopping engine would have produced; the discarded tokens are the cost.
- `rollout.generate_max_len` budgets the whole response: student turns, observations and
  replayed turns together. A turn cut by the budget ends the episode ("length").
- Observations and replayed turns are encoded as plain text (no chat role markers) right after
  the turn: the tiny demo models are trained on that layout; a chat model's tool role is an
  environment's choice of observation text.
- An episode that ends without an EOS (budget, turn cap, a tool call left unanswered) gets the
  tokenizer's EOS appended to its last student turn, as SPEC §1 does for every response; that
  EOS has no rollout log-prob.
- Samples draw from (seed + turn · 1_000_003, sample id), so every turn samples afresh and a
  rerun with the same seed is identical.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ctopd_jax.algorithms.turns import CONTEXT, STUDENT, Episode, paragraph_turns
from ctopd_jax.envs import run_step
from ctopd_jax.rollout.base import FINISH_LENGTH, FINISH_STOP, SamplingParams

FINISH_TURNS = "turns"      # the turn cap ended the episode


def cut_at_stop(side, tokens, logprobs, stop: str | None):
    """The turn up to and including the first token that completes `stop` in the text."""
    if not stop:
        return tokens, logprobs, False
    text = b""
    want = stop.encode()
    for i, t in enumerate(tokens):
        text += side.token_bytes[int(t)]
        if want in text:
            return tokens[:i + 1], logprobs[:i + 1], True
    return tokens, logprobs, False


def _paragraph_segments(episode: Episode, side, tokens, logprobs, turn_limit: int | None) -> bool:
    """Add a single-turn response as one student segment per paragraph (at most `turn_limit`);
    True when the limit cut it."""
    index = paragraph_turns([side.token_bytes[int(t)] for t in tokens])
    cut = len(tokens)
    if turn_limit is not None and len(index) and index[-1] >= turn_limit:
        cut = int((index < turn_limit).sum())
    start = 0
    for k in range(int(index[cut - 1]) + 1 if cut else 0):
        stop = int((index[:cut] <= k).sum())
        episode.add(tokens[start:stop], STUDENT, logprobs[start:stop])
        start = stop
    return cut < len(tokens)


def _close(episode: Episode, side, eos_ids) -> None:
    """Append the EOS when the episode's last student token is not one (see the decisions)."""
    last = next((s for s in reversed(episode.segments) if s.role == STUDENT), None)
    if episode.segments and episode.segments[-1] is last and last.ids and last.ids[-1] in eos_ids:
        return
    if episode.segments and episode.segments[-1] is last:
        last.ids.append(side.eos_id)
        last.logprobs = None if last.logprobs is None else last.logprobs + [float("nan")]
    else:
        episode.add([side.eos_id], STUDENT, None)


def play(engine, side, prompts: Sequence, prompt_ids: Sequence[Sequence[int]], params, *,
         environment: Callable[[], object] | None = None, max_turns: int = 8,
         turn_limit: int | None = None, expert_turns: Sequence[Sequence[str]] | None = None,
         step_timeout_s: float = 10.0) -> list[Episode]:
    """One episode per (prompt, prompt_ids) pair; `params.n` must be 1 (expand prompts first)."""
    eos_ids = set(getattr(engine, "eos_ids", ())) | {side.eos_id}
    budget = params.max_new_tokens
    episodes = [Episode(list(p)) for p in prompt_ids]
    envs = [environment() for _ in episodes] if environment is not None else [None] * len(episodes)
    stop = getattr(envs[0], "tool_stop", None) if envs and envs[0] is not None else None
    # generate calls: one per turn with an environment; one in all for paragraph turns (where
    # `turn_limit` cuts the paragraphs instead)
    cap = 1 if environment is None else min(max_turns, turn_limit or max_turns)
    for b, (ep, env) in enumerate(zip(episodes, envs)):
        if env is not None:
            ep.add(side.encode(env.reset(prompts[b])), CONTEXT)
        for text in (expert_turns[b] if expert_turns is not None else ()):
            if env is None:   # replayed paragraphs, each closed by the blank line that splits them
                ep.add(side.encode(text + "\n\n"), CONTEXT)
                continue
            ep.add(side.encode(text), CONTEXT)
            result = run_step(env, text, step_timeout_s)
            ep.reward += result.reward
            ep.add(side.encode(result.observation), CONTEXT)
            ep.done = ep.done or result.done
    for turn in range(cap):
        active = [b for b, ep in enumerate(episodes) if not ep.done and ep.response_len < budget]
        for b, ep in enumerate(episodes):
            if not ep.done and ep.response_len >= budget:
                ep.done, ep.finish_reason = True, FINISH_LENGTH
        if not active:
            break
        contexts = [episodes[b].prompt_ids + [t for s in episodes[b].segments for t in s.ids] for b in active]
        room = max(budget - episodes[b].response_len for b in active)
        result = engine.generate(contexts, params.replace(n=1, max_new_tokens=room,
                                                          seed=params.seed + turn * 1_000_003))
        for j, b in enumerate(active):
            ep, env = episodes[b], envs[b]
            tokens = list(result.token_ids[j])[:budget - ep.response_len]
            lps = list(result.logprobs[j])[:len(tokens)]
            ended = bool(tokens) and tokens[-1] in eos_ids
            if env is None:
                limited = _paragraph_segments(ep, side, tokens, lps, turn_limit)
                ep.done = True
                ep.finish_reason = FINISH_TURNS if limited else (FINISH_STOP if ended else FINISH_LENGTH)
                continue
            tokens, lps, called = cut_at_stop(side, tokens, lps, stop)
            ep.add(tokens, STUDENT, lps)
            if not (ended or called):      # the budget cut the turn
                ep.done, ep.finish_reason = True, FINISH_LENGTH
                continue
            step = run_step(env, side.decode(tokens), step_timeout_s)
            ep.reward += step.reward
            if step.done:
                ep.done, ep.finish_reason = True, FINISH_STOP
            elif turn + 1 == cap:      # nobody reads the observation: the episode ends on the turn
                ep.done, ep.finish_reason = True, FINISH_TURNS
            else:
                ep.add(side.encode(step.observation), CONTEXT)
    for ep in episodes:
        _close(ep, side, eos_ids)
    return episodes


def greedy_reward(engine, side, prompts, environment, *, max_new_tokens: int, max_turns: int = 8,
                  step_timeout_s: float = 10.0) -> tuple[float, list[Episode]]:
    """Mean environment reward of greedy episodes over `prompts` (data.Prompt rows): the
    held-out accuracy of a tool task whose environment rewards a correct final answer."""
    encoded = [side.encode(side.render_chat(list(p.messages), add_generation_prompt=True)) for p in prompts]
    episodes = play(engine, side, prompts, encoded, SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens),
                    environment=environment, max_turns=max_turns, step_timeout_s=step_timeout_s)
    return sum(ep.reward for ep in episodes) / max(len(episodes), 1), episodes
