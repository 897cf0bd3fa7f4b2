"""What records the first step: every module call tapped on both sides (``intercept``), the recorded
values read back (``recorded``), the two sides' calls paired (``pairing``), and the recording's
programs, traced, pruned to what is kept and compiled (``pruned``).

May import: ``state``, ``port``, ``rng``.
"""
