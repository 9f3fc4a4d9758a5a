"""Strict top-k objective (SPEC §4, `topk_byte_align_ctkd`): the student picks k columns."""
