"""Structured output outside the engine loop: the limits a constraint is checked against, and its guarded compile."""
