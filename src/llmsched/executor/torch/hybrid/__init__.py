"""Hybrid models: Mamba2 state-space layers beside attention layers (Bamba)."""
