"""Analyses: questions about graphs that several passes ask, answered in one place and never cached on the
graphs themselves (aliases: which values may share memory)."""
