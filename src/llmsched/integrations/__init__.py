"""Bridges to other serving engines; each imports its engine only inside its own package."""
