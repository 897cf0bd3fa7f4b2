"""The port API and reading states: what a port is, its fields checked, the two sides' names
paired, and both frameworks' states in one neutral form.

May import: nothing else of ``core`` (``equivalence.distributed``'s helpers, the two implementations).
"""
