"""Ragged decode attention over a paged KV cache (one query token per row); see api.py."""
