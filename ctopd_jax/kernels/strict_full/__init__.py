"""Strict full shared-vocabulary objective (SPEC §4, `byte_align_ctkd`)."""
