"""The random numbers both sides draw: the Dropout bridge (``randomness``, ``masks``), NNX's streams
(``streams``), and the draws a run makes, recorded (``draws``).

May import: ``state``, ``port``.
"""
