"""Leaf paths, the one vocabulary of both frameworks' state: ``'0/mu/fc1/kernel'``.

Owned here so that ``convert`` (state -> named arrays) and ``naming`` (which linen path is
which NNX path) both read paths the same way without importing each other. No JAX.
"""

from collections.abc import Mapping
from typing import Any


def key_name(entry: Any) -> str:
    """One pytree key as a path component: dict keys, list indices and namedtuple fields alike."""
    for attr in ('key', 'name', 'idx'):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def rename_path(path: str, mapping: Mapping[str, str]) -> str:
    """A path that ends in a linen leaf path (``0/mu/Dense_0/kernel``), with that end renamed."""
    parts = path.split('/')
    for i in range(len(parts)):
        tail = '/'.join(parts[i:])
        if tail in mapping:
            return '/'.join([*parts[:i], mapping[tail]])
    return path


def rename(neutral: dict[str, dict[str, Any]], mapping: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """A legacy neutral tree with linen leaf paths replaced by their NNX paths, in every group:
    parameters and EMA by path, optimizer state and statistics where a path ends in one."""
    return {group: {rename_path(p, mapping): a for p, a in leaves.items()} for group, leaves in neutral.items()}
