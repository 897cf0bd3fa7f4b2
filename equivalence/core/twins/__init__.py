"""The floors and their twins: the run's own program from nudged inputs or other device counts
(``twin``), in a fresh process (``fresh``), the pmap side's own twin (``legacy_twin``), the
first-step gradient probe (``probe``), and NOT VERIFIED (``unverified``).

May import: ``state``, ``port``, ``rng``, ``measure``, ``record``, ``compare``, ``run``.
"""
