"""Feeds ``legacy_pmap`` and ``nnx_sharded`` the same seeds and data, and compares them.

Importing this package does not start JAX: the CLIs must request simulated devices first.
"""
