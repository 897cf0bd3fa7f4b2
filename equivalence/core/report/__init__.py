"""The report: text, JSON, plots, and writing them where the user asked.

May import: ``port``, ``run``, ``verdict``.
"""
