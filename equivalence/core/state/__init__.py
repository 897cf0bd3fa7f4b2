"""Both frameworks' train states read into one neutral form: leaf paths (``paths``), the conversion
(``convert``), what is not compared (``states``), the new side's forms (``new_side``), a report line
that is also a value (``line``).

May import: nothing of ``core``.
"""
