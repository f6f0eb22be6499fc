"""Speculative decoding: proposers of draft tokens, and the target's lossless verification (in model/sampler.py)."""
