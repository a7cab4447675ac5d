"""llmsched: an LLM serving engine built around an exact, explainable step scheduler."""

__version__ = "0.1.0"
