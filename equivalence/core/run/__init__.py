"""Running the two paths: each side's setup and compiled call, real step forms, the randomness bridge.

May import: ``port``.
"""
