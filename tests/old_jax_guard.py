"""jax 0.4.38's names, and no others, to the code of this repository (``install``): each module ``old_jax_names``
read is given a class whose attribute lookup refuses, to a caller in this repository, a public name that module
did not have in jax 0.4.38, flax 0.10.2 and optax 0.2.4. JAX's and flax's own code, and names set after the guard
(``equivalence.compat`` gives its stand-ins), are left alone. What the recorder runs, so guarded, raises
``AttributeError`` where the classic pmap's environment would (``jax.lax.axis_size``, issue 60)."""

import importlib
import json
import os
import sys
import types

import old_jax_names

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFUSED: list[str] = []  # what was refused, by module and name


def _guarded(module: types.ModuleType, allowed: set[str]) -> type:
    base = type(module)

    class Guarded(base):
        def __getattribute__(self, name):
            if not name.startswith('_') and name not in allowed:
                caller = sys._getframe(1).f_code.co_filename
                ours = caller.startswith(ROOT) and 'site-packages' not in caller and '/tests/' not in caller
                if ours and not caller.endswith(os.path.join('equivalence', 'compat.py')):  # it asks what is there
                    REFUSED.append(f'{module.__name__}.{name}')
                    raise AttributeError(f"module {module.__name__!r} has no attribute {name!r} (jax 0.4.38's)")
            return base.__getattribute__(self, name)

    return Guarded


def install() -> None:
    from equivalence import compat

    with open(old_jax_names.PATH) as f:
        known = json.load(f)['modules']
    given: dict[str, set] = {}
    for dotted in compat.GIVEN:  # compat gives these on the old JAX: the recorder may use them
        owner, _, name = dotted.rpartition('.')
        given.setdefault(owner, set()).add(name)
    for name, allowed in known.items():
        module = importlib.import_module(name)
        module.__class__ = _guarded(module, {*allowed, *given.get(name, ())})
