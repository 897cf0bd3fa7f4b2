"""The public names jax 0.4.38 (with flax 0.10.2 and optax 0.2.4) has, module by module, for ``test_record``'s
recording with every other name hidden (``old_jax_guard``). Written once, in an environment of those versions:

    python tests/old_jax_names.py --write      # in a venv of jax 0.4.38, flax 0.10.2, optax 0.2.4

which writes ``tests/data/jax0.4.38_names.json``."""

import importlib
import json
import os
import sys

MODULES = (
    'jax', 'jax.lax', 'jax.numpy', 'jax.random', 'jax.tree', 'jax.tree_util', 'jax.nn', 'jax.sharding', 'jax.debug',
    'jax.dtypes', 'jax.experimental', 'jax.extend', 'jax.extend.core', 'jax.core', 'flax', 'flax.linen', 'flax.core',
    'flax.struct', 'flax.training', 'flax.training.train_state', 'flax.jax_utils', 'flax.nnx', 'optax',
)  # fmt: skip
PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', 'jax0.4.38_names.json')


def names() -> dict:
    import jax

    out = {'versions': {m: importlib.import_module(m).__version__ for m in ('jax', 'flax', 'optax')}, 'modules': {}}
    for name in MODULES:  # every one imported first: a package's names include its submodules
        importlib.import_module(name)
    for name in MODULES:
        out['modules'][name] = sorted(dir(importlib.import_module(name)))
    assert out['versions']['jax'] == '0.4.38', jax.__version__
    return out


if __name__ == '__main__' and '--write' in sys.argv:
    with open(PATH, 'w') as f:
        json.dump(names(), f, indent=0, sort_keys=True)
    print('wrote', PATH)
