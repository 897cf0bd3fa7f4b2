"""The verdict corpus: ports whose truth is known, to judge the verdict (issue 16, point 5).

Correct ports that are ill-conditioned on purpose (Adam's eps at 1e-9, a bias before
BatchNorm, ``cnn`` over seeds and strategies, a Transformer with dropout, 20 steps) must
MATCH; ports with one constant slipped on the NNX side must MISMATCH, and once the verdict
diagnoses, name the right kind. Every port goes through the public API (``ModelPort``,
``LoopPort``, ``equivalence.check``) as a user's would.

- ``entry``: what an entry is (no JAX); ``runner``: the runs and the confusion matrix;
  ``table``: what the command prints; ``__main__``: ``python -m equivalence.corpus``.
- The families, one module each, build the ports and list their entries (``ENTRIES``):
  ``transformer`` and ``transformer_loop``, ``batchnorm``, ``builtin`` (cnn, wide, mlp).

Importing this package imports no JAX: ``entries()`` loads the families on first use.
"""

import importlib

FAMILIES = ('transformer', 'transformer_loop', 'batchnorm', 'builtin', 'precision')


def entries() -> list:
    """Every entry, in family order (``entry.Entry``); imports the families, and with them JAX."""
    found = [e for family in FAMILIES for e in importlib.import_module(f'{__name__}.{family}').ENTRIES]
    names = [e.name for e in found]
    if len(set(names)) != len(names):
        raise ValueError(f'corpus entries must have distinct names: {names}')
    return found


def select(names: list[str] | None = None, quick: bool = False) -> list:
    """The named entries (all when ``names`` is None), only the --quick ones if asked;
    ``KeyError`` names the first unknown name."""
    everything = {e.name: e for e in entries()}
    for name in names or []:
        if name not in everything:
            raise KeyError(name)
    chosen = [everything[n] for n in names] if names else list(everything.values())
    return [e for e in chosen if e.quick or not quick]
