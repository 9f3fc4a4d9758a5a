"""The text adventure: expert lists are solutions and shortest (BFS over an independent model
of the house written here), bad actions are observations, episodes are deterministic."""
from collections import deque

import pytest

from ctopd_jax.data.prompts import Prompt
from ctopd_jax.envs import EnvConfigError, StepResult, make_environment, run_step
from ctopd_jax.envs.text_world import TASKS, task_rows

# The oracle's own model of the house, written from the specification, not from the module.
ADJACENT = {("kitchen", "hall"), ("hall", "garden"), ("kitchen", "cellar"), ("hall", "study")}
ADJACENT |= {(b, a) for a, b in ADJACENT}
LOCKED_PAIR = {"hall", "study"}
ROOMS = ["kitchen", "hall", "garden", "cellar", "study"]
ITEMS = ["key", "apple", "lamp", "book", "coin"]
CARRIED = "inventory"


def _successors(state):
    """(action, next state) for every action that changes the state."""
    room, where, locked = state
    where = dict(where)
    for target in ROOMS:
        if (room, target) in ADJACENT and not ({room, target} == LOCKED_PAIR and locked):
            yield f"go {target}", (target, tuple(sorted(where.items())), locked)
    for item in ITEMS:
        if where[item] == room:
            yield f"take {item}", (room, tuple(sorted({**where, item: CARRIED}.items())), locked)
        if where[item] == CARRIED:
            yield f"drop {item}", (room, tuple(sorted({**where, item: room}.items())), locked)
    if locked and room in LOCKED_PAIR and where["key"] == CARRIED:
        yield "open door", (room, tuple(sorted(where.items())), False)


def _shortest(task):
    start = (task.start_room, tuple(sorted(task.items.items())), task.door_locked)
    seen, queue = {start}, deque([(start, 0)])
    while queue:
        state, depth = queue.popleft()
        for _, nxt in _successors(state):
            if dict(nxt[1])[task.item] == task.room:
                return depth + 1
            if nxt not in seen:
                seen.add(nxt)
                queue.append((nxt, depth + 1))
    return None


def _prompt(task_id, source="world.jsonl:1"):
    return Prompt(messages=({"role": "user", "content": "play"},), source=source,
                  extra={"task_id": task_id})


def _env(task_id="apple_to_hall"):
    env = make_environment("text_world")
    env.reset(_prompt(task_id))
    return env


def test_at_least_six_tasks_with_distinct_ids():
    assert len(TASKS) >= 6
    assert len({task.id for task in TASKS}) == len(TASKS)


@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
def test_expert_actions_solve_the_task_in_exactly_their_length(task):
    env = make_environment("text_world")
    first = env.reset(_prompt(task.id))
    assert task.goal in first and f"You are in the {task.start_room}" in first
    for i, action in enumerate(task.expert_actions):
        result = env.step(action)
        last = i == len(task.expert_actions) - 1
        assert result.done == last and result.reward == (1.0 if last else 0.0), (i, action, result)


@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
def test_expert_actions_are_shortest_by_bfs(task):
    assert dict(task.items)[task.item] != task.room        # not solved at the start
    assert _shortest(task) == len(task.expert_actions)


def test_some_task_needs_the_locked_door():
    assert any("open door" in task.expert_actions for task in TASKS)


def test_actions_are_case_and_punctuation_insensitive_first_line_only():
    env = _env("apple_to_hall")
    assert env.step("  Take the APPLE.\nthen go hall").observation == "You take the apple."
    assert env.step("\n\nGo to the Hall!").observation.startswith("You are in the hall.")
    assert env.step("drop apple") .done


@pytest.mark.parametrize("text, expected", [
    ("dance", "I don't understand 'dance'. Actions: go ROOM, take ITEM, drop ITEM, open door, "
              "look, inventory."),
    ("", "I don't understand ''"),
    ("go", "I don't understand 'go'"),
    ("take sword", "There is no item called 'sword'"),
    ("drop coin", "You don't have the coin."),
    ("take coin", "There is no coin here."),
    ("go moon", "There is no room called 'moon'"),
    ("go garden", "You can't go to the garden from the kitchen."),
    ("go study", "You can't go to the study from the kitchen."),
    ("go kitchen", "You are already in the kitchen."),
    ("open door", "There is no door here."),
    ("open window", "You can't open the window."),
])
def test_bad_actions_are_observations(text, expected):
    result = _env("apple_to_hall").step(text)   # starts in the kitchen
    assert expected in result.observation
    assert (result.reward, result.done) == (0.0, False)


def test_locked_door_then_open_with_the_key():
    env = _env("apple_to_study")                 # kitchen, key in the cellar, door locked
    env.step("go hall")
    assert env.step("go study") == StepResult("The door is locked.", 0.0, False)
    assert "need the key" in env.step("open door").observation
    for action in ("go kitchen", "go cellar", "take key", "go kitchen", "go hall"):
        assert not env.step(action).done
    assert "unlock" in env.step("open door").observation
    assert "already open" in env.step("open door").observation
    assert env.step("go study").observation.startswith("You are in the study.")


def test_look_and_inventory():
    env = _env("coin_to_study_with_key")         # garden, key carried
    assert env.step("inventory").observation == "You carry key."
    look = env.step("look").observation
    assert look.startswith("You are in the garden.") and "coin" in look
    env.step("take coin")
    assert env.step("inventory").observation == "You carry key, coin."


def test_same_actions_give_the_same_observations():
    actions = ["look", "dance", "go hall", "take lamp", "go study", "inventory", "go kitchen",
               "drop lamp", "go cellar", "take key", "go kitchen", "take lamp", "go hall",
               "open door", "go study", "drop lamp"]

    def play(env):
        obs = [env.reset(_prompt("book_to_garden"))]
        return obs + [env.step(action) for action in actions]

    env = make_environment("text_world")
    first = play(env)
    assert play(env) == first                                     # reset clears the state
    assert play(make_environment("text_world")) == first


def test_reset_restores_the_start_state():
    env = _env("apple_to_hall")
    env.step("take apple")
    env.step("go hall")
    env.reset(_prompt("apple_to_hall"))
    assert env.step("inventory").observation == "You carry nothing."
    assert env.step("look").observation.startswith("You are in the kitchen.")


@pytest.mark.parametrize("extra", [{"task_id": "nope"}, {}])
def test_unknown_or_missing_task_id_names_the_row_and_the_ids(extra):
    prompt = Prompt(messages=({"role": "user", "content": "x"},), source="world.jsonl:7",
                    extra=extra)
    with pytest.raises(EnvConfigError) as info:
        make_environment("text_world").reset(prompt)
    message = str(info.value)
    assert "world.jsonl:7" in message and "task_id" in message
    assert all(task.id in message for task in TASKS)


def test_task_rows_cover_every_task():
    rows = task_rows()
    assert [row["task_id"] for row in rows] == [task.id for task in TASKS]
    for row, task in zip(rows, TASKS):
        assert set(row) == {"prompt", "task_id", "expert_actions", "answer"}
        assert row["expert_actions"] == list(task.expert_actions)
        assert task.goal in row["prompt"] and "Reply with one action per turn." in row["prompt"]
        assert row["answer"] == ""


def test_step_after_the_goal_goes_through_run_step_without_raising():
    env = _env("apple_to_hall")
    for action in ("take apple", "go hall"):
        env.step(action)
    assert run_step(env, "drop apple", 5.0).reward == 1.0
    result = run_step(env, "look", 5.0)
    assert result.done and result.observation.startswith("error: ")
