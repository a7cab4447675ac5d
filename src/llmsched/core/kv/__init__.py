"""Paged KV cache bookkeeping: blocks, free queue, hashing, the manager."""
