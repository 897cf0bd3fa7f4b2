"""The same training in Flax NNX on a ``jax.sharding.Mesh``.

Replicated model and optimizer, batch sharded over the mesh's data axis, K steps fused
by a scan inside one compiled call, no explicit ``pmean``: the compiler inserts the
gradient all-reduce. This package never imports ``legacy_pmap`` or ``equivalence``.
"""
