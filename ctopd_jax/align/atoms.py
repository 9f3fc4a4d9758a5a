"""MP-OPD atoms (SPEC §8): the minimal synchronised segments, EOS masked.

Atoms are all groups of the strict alignment (strict pairs and mismatch groups alike, in
order; the final EOS is not on the ruler). A sample fails validation when its bytes differ
between the sides or its response text holds U+FFFD (a decode with the replacement character);
it contributes no atoms and is counted.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ctopd_jax.align.strict import StrictAlignment
from ctopd_jax.tokenization.retokenize import RetokenizedBatch


@dataclasses.dataclass(frozen=True, eq=False)
class Atoms:
    atoms: np.ndarray          # int32 [A, 5]: sample, t_start, t_end, s_start, s_end (flat logits
    #                            rows, end exclusive)
    sample_valid: np.ndarray   # bool [B]

    @property
    def num_invalid(self) -> int:
        return int((~self.sample_valid).sum())

    @property
    def student_tokens(self) -> np.ndarray:
        """int32 [A]: w_i, the number of student tokens in each atom."""
        return (self.atoms[:, 4] - self.atoms[:, 3]).astype(np.int32)


def mpopd_atoms(teacher: RetokenizedBatch, student: RetokenizedBatch,
                alignment: StrictAlignment) -> Atoms:
    valid = ~alignment.byte_mismatch & np.array(["\ufffd" not in r for r in teacher.responses])
    groups = alignment.groups
    keep = valid[groups.sample]
    sample = groups.sample[keep]

    def rows(batch, token):
        return batch.row_base[sample] + token - batch.resp_offsets[:-1][sample]

    atoms = np.stack([sample, rows(teacher, groups.t_first[keep]),
                      rows(teacher, groups.t_last[keep] + 1), rows(student, groups.s_first[keep]),
                      rows(student, groups.s_last[keep] + 1)], axis=1)
    return Atoms(atoms=atoms.astype(np.int32).reshape(-1, 5), sample_valid=valid)
