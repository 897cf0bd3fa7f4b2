"""What ``jax.pmap`` made: a pmapped function recognised, and the function it wraps (teams hand over
``p_train_step``, or call it inside the step they hand over)."""

import functools
import sys
from typing import Any


@functools.cache
def _pmap_code() -> Any:
    """The code object of every function ``jax.pmap`` returns (jax >= 0.8 builds it in Python)."""
    import jax

    return getattr(jax.pmap(lambda x: x), '__code__', None)


def pmapped(fn: Any) -> Any | None:
    """What ``jax.pmap`` wrapped, if ``fn`` is a pmapped function (teams hand over ``p_train_step``), else
    None. jax 0.10's pmap is a plain function, one code object for all, keeping the original as
    ``__wrapped__``; older JAX's a ``PmapFunction``. No JAX imported where none is: nothing can be pmapped."""
    if 'jax' not in sys.modules or not callable(fn):
        return None
    code = getattr(fn, '__code__', None)
    if (code is None or code is not _pmap_code()) and type(fn).__name__ != 'PmapFunction':
        return None
    return getattr(fn, '__wrapped__', None)
