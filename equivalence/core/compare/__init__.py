"""The comparison and the verdict as values: leaf by leaf to a floor (``compare``), the rule and the
diagnosis (``rule``), the findings it rests on (``findings``), the outcome (``outcome``), and where
the sides part, as a value (``location``). It knows no framework and runs nothing.

May import: ``state``, ``port``.
"""
