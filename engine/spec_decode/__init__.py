"""Speculative decoding's parts that need no model: proposals by prompt lookup (ngram.py)
and acceptance that keeps the target's distribution exactly (acceptance.py). The decode
step that verifies a row's k proposals in one forward pass builds on them."""
