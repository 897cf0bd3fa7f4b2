"""The public surface: what a port is (``ports``), its fields checked (``port_fields``), its kind and step form
decided once (``kind``, ``step_forms``), the two sides' names paired (``naming``), the typed flags (``config``),
the built-in workloads, loading a port by name, and whose an exception is (``blame``).

May import: ``state`` (``equivalence.distributed``'s helpers, the two implementations).
"""
