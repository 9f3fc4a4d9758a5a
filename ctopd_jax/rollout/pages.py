"""Host-side bookkeeping of the JAX sampler's page pool: which pages are free, which prompt
owns which pages, which pages a decode slot owns, and the admission / preemption rules.

Layout of a slot's page table row (models/kv_cache.py, PagedKVCache): the first P // page
columns are its prompt's full pages, shared by every sample of the prompt (one prefill for
the n samples); a prompt whose length is not a multiple of the page size also has a partial
last page, which each sample copies into a page of its own at admission (it writes its first
generated tokens there). The pages after that are the sample's own, taken one at a time by
the decode loop on the device when a row's length reaches a page boundary (it pops them from
the top of the free stack this class hands it, so host and device agree on which pages went).

Admission: a sample is admitted into a free slot while the pool keeps, after its prompt's
pages (if the prompt is not resident yet) and its tail copy, at least one free page per
occupied slot (each may need a page at its next step). Otherwise it waits (stays pending).

When the pool runs dry (the decode loop stops before a step whose rows may need more pages
than are free): the occupied sample with the highest index is preempted, its own pages freed,
and it goes back to the front of the queue; it is recomputed from its prompt later. Its
randomness depends only on (seed, sample index, step), so the recomputed tokens are the ones
it would have produced; the schedule is a pure function of the inputs, so reruns are
bit-exact. A prompt's pages are freed when its last sample finishes.
"""
from __future__ import annotations

import dataclasses


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass
class ResidentPrompt:
    pages: list[int]       # all the prompt's pages (the last one partial when P % page)
    logits: object         # the last prompt position's logits [V] (host float32)


class PagePool:
    def __init__(self, pages: int, page_size: int, prompt_lengths: list[int],
                 samples_per_prompt: list[int]):
        self.page_size = page_size
        self.free = list(range(pages - 1, -1, -1))   # a stack: the top (end) is page 0
        self.prompt_lengths = prompt_lengths
        self.unfinished = list(samples_per_prompt)    # samples of each prompt not yet done
        self.resident: dict[int, ResidentPrompt] = {}
        self.total = pages
        self.peak_used = 0

    # -- admission --------------------------------------------------------------------------
    def admission_cost(self, prompt: int) -> int:
        """Pages admitting one sample of `prompt` takes now."""
        length = self.prompt_lengths[prompt]
        tail = 1 if length % self.page_size else 0
        return tail + (0 if prompt in self.resident else cdiv(length, self.page_size))

    def can_admit(self, prompt: int, occupied_after: int) -> bool:
        return len(self.free) - self.admission_cost(prompt) >= occupied_after

    def take(self, count: int) -> list[int]:
        got = [self.free.pop() for _ in range(count)]
        self._note_use()
        return got

    def admit(self, prompt: int, logits_of_new_prompt=None):
        """(page-table prefix of the slot, (src, dst) of its tail copy or None, whether the
        prompt must be prefilled). The caller prefills new prompts before the copies run."""
        length, page = self.prompt_lengths[prompt], self.page_size
        new = prompt not in self.resident
        if new:
            self.resident[prompt] = ResidentPrompt(self.take(cdiv(length, page)), None)
        pages = self.resident[prompt].pages
        row = pages[:length // page]
        copy = None
        if length % page:
            private = self.take(1)[0]
            copy = (pages[-1], private)
            row = row + [private]
        return row, copy, new

    # -- the device's pops and the slots' releases -------------------------------------------
    def popped_to(self, free_top: int) -> None:
        """The decode loop took the pages above `free_top` from the stack."""
        del self.free[free_top:]
        self._note_use()

    def release(self, prompt: int, table_row, length: int, finished: bool) -> None:
        """A slot gives back its own pages (columns from its prompt's shared ones to its last
        used one); a finished sample may also release its prompt's pages."""
        shared = self.prompt_lengths[prompt] // self.page_size
        self.free.extend(int(p) for p in reversed(table_row[shared:cdiv(length, self.page_size)]))
        if finished:
            self.unfinished[prompt] -= 1
            if self.unfinished[prompt] == 0:
                self.free.extend(reversed(self.resident.pop(prompt).pages))

    def _note_use(self) -> None:
        self.peak_used = max(self.peak_used, self.total - len(self.free))
