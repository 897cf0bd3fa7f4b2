"""A linen model wrapped by ``nnx.bridge.ToNNX`` and trained in NNX, checked against its pmap loop.

The fastest migration of a large linen model: keep the model, wrap it, train the wrapper in NNX.

- ``legacy_code.py``: a small vision transformer in linen (strided-conv patches, ``LayerNorm``,
  self-attention with attention dropout, an MLP with ``nn.Dropout``), AdamW with a warmup-cosine
  schedule in a flax ``TrainState``, ``train_step(state, batch, dropout_rng)`` under
  ``jax.pmap(..., axis_name='batch')``, the key handed to ``apply(rngs={'dropout': dropout_rng})``;
- ``nnx_code.py``: the same linen module wrapped by ``bridge.ToNNX`` and built by ``bridge.lazy_init``,
  ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, one ``nnx.jit`` step over the global batch.

The wrapper's variables keep linen's paths (``Block_0/Dense_0/kernel``), so no ``names=``.

**The key rule.** ``ToNNX`` does not hand linen an ``nnx.Rngs``'s keys: for each stream it hands
``stream()``, ``fold_in(key, count)`` (flax 0.12.8, ``nnx/bridge/wrappers.py`` 189-190;
``nnx/rnglib.py`` 120-124), whether the ``nnx.Rngs`` is the one the module was built with (forked
at construction, line 139) or one passed at call time, and ``nnx.reseed`` stores ``fold_in(key, 0)``.
So an NNX step that reseeds the wrapper with the pmap step's key, or calls it with
``rngs=nnx.Rngs(dropout=key)``, draws other dropout masks than ``apply(rngs={'dropout': key})``:
``LOOP_RNGS_SLIP``, exit 1, from the first step. ``LOOP`` hands linen the key itself: a
``nnx.Rngs`` whose ``items()`` yield the streams' keys (``nnx_code.KeyRngs``). ``LOOP_RAW_KEY`` hands
the key array as it is (``rngs=dropout_rng``: linen gets ``{'params': key}``, and ``make_rng('dropout')``
falls back to it): the same masks bit for bit when the model draws from no stream but ``dropout``; the suite's
bridge follows linen's fallback too, and it MATCHes.

python -m equivalence.run --workload my_port:LOOP             # exit 0: MATCH
python -m equivalence.run --workload my_port:LOOP_RAW_KEY     # exit 0: the key array, linen's fallback
python -m equivalence.run --workload my_port:LOOP_RNGS_SLIP   # exit 1: the wrapped Dropouts draw other masks
python -m pytest                                              # D = 1, 2, 4, 8 and the slip
"""

import dataclasses

import legacy_code as old
import nnx_code as new
from flax import nnx

from equivalence import LoopPort

LOOP = LoopPort(
    name='bridge-port',
    legacy_model=old.Classifier,
    nnx_model=new.create_model,  # (nnx.Rngs) -> ToNNX(Classifier()), lazily initialised; given linen's weights
    make_data=old.make_data,
    legacy_state=lambda v: old.create_train_state(v['params']),
    legacy_step=old.train_step,
    new_state=lambda model: (model, new.create_optimizer(model)),
    new_step=lambda ts, batch, key: new.train_step(*ts, batch, key),
    step_form='state_rng',  # train_step(state, batch, dropout_rng), a fresh key every step
    loss='loss',
    init_args=lambda batch: (batch['image'],),
    init_kwargs=lambda batch: {'train': False},
    rng_modes=('global',),  # the NNX step takes one key for the global batch
    default_batch=16,
)

# The slip: the wrapper's own nnx.Rngs, reseeded with the step's key as native NNX code does; linen
# gets fold_in of it, not the key the pmap step hands apply(rngs={'dropout': ...}).
LOOP_RNGS_SLIP = dataclasses.replace(
    LOOP,
    nnx_model=lambda rngs: new.create_model(nnx.Rngs(params=rngs.params(), dropout=0)),
    new_step=lambda ts, batch, key: new.train_step_reseeded(*ts, batch, key),
)

# The plainest form, the key array itself (linen's 'params' fallback): matches, here and on its own.
LOOP_RAW_KEY = dataclasses.replace(LOOP, new_step=lambda ts, batch, key: new.train_step_raw_key(*ts, batch, key))
