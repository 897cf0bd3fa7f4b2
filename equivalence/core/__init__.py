"""The suite's library, in rooms whose imports run one way (``docs/layout.md``):

``port`` (the port API, reading states) < ``run`` (setting up and running the two paths) <
``preflight`` and ``verdict`` (each may run the paths, never the reverse) < ``report`` <
``harness`` (the orchestration: pre-flight, paths, verdict). ``tests/test_layout.py`` holds them to it.
"""
