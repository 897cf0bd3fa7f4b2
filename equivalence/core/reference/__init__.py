"""A reference: the pmap side recorded once where its code runs, its file (``reference``: ``.npz`` with
a JSON manifest and a sha256 per array), and that side recorded and read back in its place
(``referenced``).

May import: every room below it.
"""
