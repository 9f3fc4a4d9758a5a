"""A small deterministic text adventure: carry an item to a room, one action per turn.

The house (fixed):

    cellar -- kitchen -- hall -- garden
                          |
                        [door, locked unless a task says otherwise]
                          |
                        study

Items: key, apple, lamp, book, coin. The door between the hall and the study opens with
`open door` (from either side) while the key is carried; it stays open. Actions, one per turn,
read from the first non-empty line of the turn (case-insensitive; surrounding whitespace and
punctuation ignored; "to", "the", "a", "an" after the verb are skipped, so "Go to the hall."
works): `go ROOM`, `take ITEM`, `drop ITEM`, `open door`, `look`, `inventory`.

A task is "put the ITEM in the ROOM": the episode ends with reward 1.0 on the step after which
the item lies in that room (dropped there); every other step has reward 0. Tasks differ in the
goal and the start state (room, where each item lies, whether the door is locked). Each stores
`expert_actions`, a shortest solution (tests replay it and confirm by BFS that none is shorter).
A bad or unknown action is answered with an observation saying so, never an exception.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ctopd_jax.envs.base import EnvConfigError, StepResult

ROOMS = ("kitchen", "hall", "garden", "cellar", "study")
ITEMS = ("key", "apple", "lamp", "book", "coin")
EXITS = {"kitchen": ("hall", "cellar"), "hall": ("kitchen", "garden", "study"),
         "garden": ("hall",), "cellar": ("kitchen",), "study": ("hall",)}
DOOR = frozenset(("hall", "study"))  # the rooms the locked door joins
INVENTORY = "inventory"  # an item's location while carried
ACTION_FORMS = "go ROOM, take ITEM, drop ITEM, open door, look, inventory"
_FILLER = {"to", "the", "a", "an"}
_PUNCT = " \t.,;:!?\"'`*()[]{}<>"

_DEFAULT_ITEMS = {"key": "cellar", "apple": "kitchen", "lamp": "hall", "coin": "garden",
                  "book": "study"}


@dataclass(frozen=True)
class Task:
    id: str
    item: str
    room: str  # the goal: `item` lies in `room`
    start_room: str
    expert_actions: tuple[str, ...]
    items: dict[str, str] = field(default_factory=lambda: dict(_DEFAULT_ITEMS))
    door_locked: bool = True

    @property
    def goal(self) -> str:
        return f"put the {self.item} in the {self.room}"


def _items(**moved: str) -> dict[str, str]:
    return {**_DEFAULT_ITEMS, **moved}


TASKS: tuple[Task, ...] = (
    Task("apple_to_hall", "apple", "hall", "kitchen",
         ("take apple", "go hall", "drop apple")),
    Task("coin_to_kitchen", "coin", "kitchen", "hall",
         ("go garden", "take coin", "go hall", "go kitchen", "drop coin")),
    Task("lamp_to_cellar", "lamp", "cellar", "garden",
         ("go hall", "take lamp", "go kitchen", "go cellar", "drop lamp")),
    Task("key_to_garden", "key", "garden", "cellar",
         ("take key", "go kitchen", "go hall", "go garden", "drop key")),
    Task("apple_to_study", "apple", "study", "kitchen",
         ("take apple", "go cellar", "take key", "go kitchen", "go hall", "open door",
          "go study", "drop apple")),
    Task("book_to_garden", "book", "garden", "kitchen",
         ("go cellar", "take key", "go kitchen", "go hall", "open door", "go study",
          "take book", "go hall", "go garden", "drop book")),
    Task("coin_to_study_with_key", "coin", "study", "garden",
         ("take coin", "go hall", "open door", "go study", "drop coin"),
         items=_items(key=INVENTORY)),
    Task("book_to_kitchen_door_open", "book", "kitchen", "hall",
         ("go study", "take book", "go hall", "go kitchen", "drop book"),
         door_locked=False),
)
_BY_ID = {task.id: task for task in TASKS}


def instruction(task: Task) -> str:
    """The user prompt of a task (what `task_rows` writes to a data file)."""
    return (f"You are in a small house with a kitchen, a hall, a garden, a cellar and a study. "
            f"Your goal: {task.goal}. Actions: {ACTION_FORMS}. Reply with one action per turn.")


def task_rows() -> list[dict]:
    """One prompt row per task, ready to be written as a jsonl data file."""
    return [{"prompt": instruction(task), "task_id": task.id,
             "expert_actions": list(task.expert_actions), "answer": ""} for task in TASKS]


def _a(item: str) -> str:
    return f"an {item}" if item[0] in "aeiou" else f"a {item}"


def _first_line(text: str) -> str:
    return next((ln for ln in text.splitlines() if ln.strip(_PUNCT)), "").strip(_PUNCT)


def parse_action(text: str) -> tuple[str, str] | None:
    """(verb, object) of a turn's first non-empty line, or None when it is no action."""
    words = _first_line(text).lower().split()
    if not words:
        return None
    verb, rest = words[0], [w.strip(_PUNCT) for w in words[1:]]
    rest = [w for w in rest if w and w not in _FILLER]
    if verb in ("look", "inventory") and not rest:
        return verb, ""
    if verb in ("go", "take", "drop", "open") and len(rest) == 1:
        return verb, rest[0]
    return None


class TextWorld:
    """The text adventure environment (see the module docstring); the task comes from the
    prompt's `task_id` column."""

    name = "text_world"
    tool_stop = None

    def __init__(self):
        self._task: Task | None = None
        self._done = True

    def reset(self, prompt) -> str:
        task_id = prompt.extra.get("task_id")
        if task_id not in _BY_ID:
            raise EnvConfigError(f"{prompt.source}: task_id={task_id!r} is not a text_world "
                                 f"task; give one of {sorted(_BY_ID)}")
        self._task = task = _BY_ID[task_id]
        self._room = task.start_room
        self._where = dict(task.items)
        self._locked = task.door_locked
        self._done = False
        return f"{self._describe()} Your goal: {task.goal}."

    def _describe(self) -> str:
        here = [_a(item) for item in ITEMS if self._where[item] == self._room]
        seen = f" You see {', '.join(here)}." if here else ""
        door = ""
        if self._room in DOOR:
            door = f" The door to the {next(iter(DOOR - {self._room}))} is " \
                   f"{'locked' if self._locked else 'open'}."
        return f"You are in the {self._room}.{seen} Exits: {', '.join(EXITS[self._room])}.{door}"

    def _go(self, room: str) -> str:
        if room not in ROOMS:
            return f"There is no room called '{room}'. Rooms: {', '.join(ROOMS)}."
        if room == self._room:
            return f"You are already in the {room}."
        if room not in EXITS[self._room]:
            return (f"You can't go to the {room} from the {self._room}. "
                    f"Exits: {', '.join(EXITS[self._room])}.")
        if {room, self._room} == DOOR and self._locked:
            return "The door is locked."
        self._room = room
        return self._describe()

    def _take(self, item: str) -> str:
        if item not in ITEMS:
            return f"There is no item called '{item}'. Items: {', '.join(ITEMS)}."
        if self._where[item] == INVENTORY:
            return f"You already have the {item}."
        if self._where[item] != self._room:
            return f"There is no {item} here."
        self._where[item] = INVENTORY
        return f"You take the {item}."

    def _drop(self, item: str) -> str:
        if item not in ITEMS:
            return f"There is no item called '{item}'. Items: {', '.join(ITEMS)}."
        if self._where[item] != INVENTORY:
            return f"You don't have the {item}."
        self._where[item] = self._room
        return f"You drop the {item}."

    def _open(self, thing: str) -> str:
        if thing != "door":
            return f"You can't open the {thing}. Only the door opens."
        if self._room not in DOOR:
            return "There is no door here."
        if not self._locked:
            return "The door is already open."
        if self._where["key"] != INVENTORY:
            return "The door is locked. You need the key."
        self._locked = False
        return "You unlock the door with the key. The door is open."

    def step(self, text: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("TextWorld.step before reset")
        if self._done:
            raise RuntimeError("TextWorld.step after the episode ended; call reset")
        action = parse_action(text)
        if action is None:
            return StepResult(f"I don't understand '{_first_line(text)[:60]}'. "
                              f"Actions: {ACTION_FORMS}.",
                              0.0, False)
        verb, obj = action
        if verb == "look":
            observation = self._describe()
        elif verb == "inventory":
            held = [item for item in ITEMS if self._where[item] == INVENTORY]
            observation = f"You carry {', '.join(held)}." if held else "You carry nothing."
        else:
            observation = {"go": self._go, "take": self._take, "drop": self._drop,
                           "open": self._open}[verb](obj)
        if self._where[self._task.item] == self._task.room:
            self._done = True
            return StepResult(f"{observation} Goal reached: you {self._task.goal}.", 1.0, True)
        return StepResult(observation, 0.0, False)
