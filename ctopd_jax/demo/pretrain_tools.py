"""The tool-use pair's pretraining pieces (`--pair char_tools`, demo/pretrain.py): the expert
transcripts as SFT batches, and held-out accuracy through the simulated tool loop."""
from __future__ import annotations

import numpy as np

from ctopd_jax.demo import tools_task
from ctopd_jax.loop.mean_at_k import stop_ids
from ctopd_jax.models import Decoder
from ctopd_jax.rollout import SamplingParams, make_rollout_engine
from ctopd_jax.tokenization import IGNORE_INDEX, TokenizerSide

TOOLS_SEQ_LEN = 80      # longest transcript: 20 prompt + 18 + 21 + 19 + EOS = 79 tokens
TOOLS_TURN_TOKENS = 24  # per generated turn (turn 1 is 18 tokens, turn 2 at most 19 + EOS)


def tools_prompt_ids(side: TokenizerSide, problem: tools_task.Problem) -> list[int]:
    return side.encode(side.render_chat([{"role": "user", "content": problem.prompt}],
                                        add_generation_prompt=True))


def tools_sft_batch(side: TokenizerSide, problems: list[tools_task.Problem]):
    """(input_ids, labels, attention_mask) of one tool-transcript SFT batch, [B, TOOLS_SEQ_LEN]:
    prompt + turn 1 + observation + turn 2 + EOS, each encoded separately (as the multi-turn
    rollout concatenates them); labels (next-token, as retokenize) on turn 1, turn 2 and EOS."""
    batch = len(problems)
    ids = np.full((batch, TOOLS_SEQ_LEN), side.pad_id, dtype=np.int32)
    labels = np.full((batch, TOOLS_SEQ_LEN), IGNORE_INDEX, dtype=np.int32)
    mask = np.zeros((batch, TOOLS_SEQ_LEN), dtype=bool)
    for b, p in enumerate(problems):
        first, second = p.expert_turns
        parts = [(tools_prompt_ids(side, p), False), (side.encode(first), True),
                 (side.encode(p.observation), False), (side.encode(second), True),
                 ([side.eos_id], True)]
        row = np.concatenate([np.asarray(t, dtype=np.int32) for t, _ in parts])
        supervised = np.concatenate([np.full(len(t), s) for t, s in parts])
        if len(row) > TOOLS_SEQ_LEN:
            raise ValueError(f"{p.prompt!r}: transcript needs {len(row)} tokens > {TOOLS_SEQ_LEN}")
        ids[b, :len(row)] = row
        mask[b, :len(row)] = True
        labels[b, :len(row) - 1] = np.where(supervised[1:], row[1:], IGNORE_INDEX)
    return ids, labels, mask


def tools_rollout(model: Decoder, side: TokenizerSide, problems: list[tools_task.Problem],
                  max_turn_tokens: int = TOOLS_TURN_TOKENS) -> list[dict]:
    """Greedy two-turn episodes with the calculator simulated here: turn 1 until ``</calc>``
    (generated to ``max_turn_tokens`` and cut, the same as stopping there under greedy decoding),
    the observation of what the model wrote (tools_task.respond), turn 2 until the EOS. A turn 1
    without a complete call ends the episode. One dict per problem: turn1, observation, turn2,
    response (the full transcript), correct."""
    engine = make_rollout_engine("jax", model, stop_ids(side), side.pad_id)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_turn_tokens)
    prompts = [tools_prompt_ids(side, p) for p in problems]
    first = engine.generate(prompts, params)
    episodes, contexts = [], []
    for i, tokens in enumerate(first.token_ids):
        text = side.decode(tokens, skip_special_tokens=False)
        turn1 = tools_task.cut_after_call(text)
        obs = None if turn1 is None else tools_task.respond(turn1)
        if obs is None:     # no tool call: the episode ends with this turn
            turn1 = side.decode(tokens)
        else:
            contexts.append((i, prompts[i] + side.encode(turn1) + side.encode(obs)))
        episodes.append({"turn1": turn1, "observation": obs, "turn2": ""})
    if contexts:
        second = engine.generate([c for _, c in contexts], params)
        for (i, _), tokens in zip(contexts, second.token_ids):
            episodes[i]["turn2"] = side.decode(tokens)
    for p, e in zip(problems, episodes):
        e["response"] = e["turn1"] + (e["observation"] or "") + e["turn2"]
        e["correct"] = tools_task.grade(e["response"], p.answer)
    return episodes


def tools_held_out_metrics(model: Decoder, side: TokenizerSide) -> dict:
    """Held-out accuracy through the tool loop, and where the misses come from."""
    problems = tools_task.split("held_out")
    episodes = tools_rollout(model, side, problems)
    n = len(problems)
    return {"held_out_accuracy": sum(e["correct"] for e in episodes) / n,
            "tool_call_exact": sum(e["turn1"] == p.expert_turns[0]
                                   for p, e in zip(problems, episodes)) / n,
            "tool_call_made": sum(e["observation"] is not None for e in episodes) / n,
            "answer_copies_observation": sum(
                e["observation"] is not None and e["turn2"] == f"The answer is "
                f"{e['observation'][len(tools_task.RESULT_OPEN):-len(tools_task.RESULT_CLOSE)]}."
                for e in episodes) / n}
