"""Speculative decoding in the torch executor: draft proposers and the verification of drafts."""
