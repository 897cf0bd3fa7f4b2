"""What a check measures of itself: each stage's wall and compile seconds (``clock``, said as records:
``said``), the host's and each device's peak bytes (``peaks``), one call's bytes per device
(``footprint``), and the precision it computes at (``precision``).

May import: ``state``, ``port``.
"""
