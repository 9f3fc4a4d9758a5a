"""Host collection of an iteration's rollouts: render → generate → decode → re-tokenize → align
(collector.py), and turn-structured episodes for tcod, sod and sage_opd (episode_collector.py)."""
