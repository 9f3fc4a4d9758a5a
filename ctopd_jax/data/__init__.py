"""What the loop reads: the resumable prompt stream (prompts.py) and the evaluation sets
(eval_sets.py)."""
