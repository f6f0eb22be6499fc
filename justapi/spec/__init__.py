"""Speculative decoding: proposers (prompt lookup, a draft model) and draft trees with their lossless verification."""
