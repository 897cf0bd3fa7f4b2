"""The verdict: the comparison, the twins that measure each port's own noise floor, the
first-step probe, the rule and the diagnosis. It may run the paths; they never call it.

May import: ``port``, ``run``.
"""
