"""Structured output: grammar compilation cache, per-request matchers (xgrammar), bitmask filling and
rollback; knows nothing of the model.
"""
