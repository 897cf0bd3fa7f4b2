"""Differences below one step's floor: a difference that grows every call with the parameter or the
update (``systematic``), and a MATCH's sensitivity.

May import: ``state``, ``port``, ``compare``.
"""
