"""Cross-tokenizer alignment: strict pairs, mismatch groups, SimCT segments, MP-OPD atoms.

All outputs are compact int32 arrays of flat logits-row indices (see ``retokenize`` for the
row convention); nothing here builds a dense [T, T] matrix.
"""
from ctopd_jax.align.atoms import Atoms, mpopd_atoms
from ctopd_jax.align.simct import SimCTSegments, simct_segments
from ctopd_jax.align.strict import (ByteMismatchError, CoverageMeter, StrictAlignment,
                                   strict_align)
from ctopd_jax.align.sync import Groups, sync_groups

__all__ = ["Atoms", "ByteMismatchError", "CoverageMeter", "Groups", "SimCTSegments", "StrictAlignment",
           "mpopd_atoms", "simct_segments", "strict_align", "sync_groups"]
