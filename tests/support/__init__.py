"""Helpers shared by several test modules (on the path through pytest's ``pythonpath``)."""
