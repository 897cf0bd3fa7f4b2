"""The porting pitfalls as executable cases: the wrong version shows the damage, the fix matches.

Each case is one module of this package; adding a pitfall means adding a module that
exposes ``NUMBER``, ``NAME``, ``TITLE``, ``DESCRIPTION`` and ``run(devices)`` (see
``base.py``). Importing this package imports no JAX: the CLI requests simulated devices
first, and only then loads the cases.
"""

import importlib
import pkgutil
from types import ModuleType

NOT_CASES = {'base'}  # helper modules; names starting with '_' are skipped too


def names() -> list[str]:
    """Every case module's name, in the order of the table (each module's ``NUMBER``)."""
    found = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith('_') and m.name not in NOT_CASES]
    return sorted(found, key=lambda name: load(name).NUMBER)


def load(name: str) -> ModuleType:
    if name.startswith('_') or name in NOT_CASES or name not in _module_names():
        raise KeyError(name)
    return importlib.import_module(f'{__name__}.{name}')


def _module_names() -> set[str]:
    return {m.name for m in pkgutil.iter_modules(__path__)}
