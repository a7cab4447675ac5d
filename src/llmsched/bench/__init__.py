"""Replay, parity checks and benchmarks driven through the engine."""
