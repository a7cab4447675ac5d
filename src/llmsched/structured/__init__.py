"""Structured outputs: grammars from output constraints, compiled off the scheduling path, and matchers.

xgrammar does the grammar work (conversion, compilation, token masks);
this package validates the constraints, caches compiled grammars by their
text, and tells the scheduler when a request's grammar is ready.
"""
