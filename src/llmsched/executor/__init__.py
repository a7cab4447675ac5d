"""Executors: what runs a scheduled batch (a fabricated replay, a real model, a cost model)."""
