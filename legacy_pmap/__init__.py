"""The linen-era reference: ``jax.pmap(jax.lax.scan(step))`` with an explicit ``lax.pmean``.

Written the way score_sde (yang-song/score_sde) wrote it. This package never imports
``nnx_sharded`` or ``equivalence``: it reads as a complete, standalone reference.
"""
