"""Comparing step traces with recorded ones."""

from __future__ import annotations


def events(kv_out: dict | None) -> dict:
    """A step's KV-connector events, invalid blocks by count only.

    vLLM frees the blocks of several requests that finish sending in one
    step in the order of a set of ids (hash-randomized per process), so
    which block ids get reused, and hence the id of a failed load's block,
    varies from run to run; the block's place in its request does not.
    """
    out = dict(kv_out or {})
    if "invalid" in out:
        out["invalid"] = len(out["invalid"])
    return out
