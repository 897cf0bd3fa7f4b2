"""The report: every sentence said of a verdict (``words``), text and JSON (``render``), plots, and writing
them where the user asked (``output``).

May import: every room but ``kinds``.
"""
