"""Speculative decoding: proposals by prompt lookup (ngram.py) or a draft model (draft.py),
the speculator that sizes them per row before a step and keeps what the target agrees
with after it (speculator.py), and model-free rejection sampling (acceptance.py)."""
