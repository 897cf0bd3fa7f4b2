"""A batch of upstream's own class in a reference: ``record`` wrote it, and ``run --reference`` refused it ('holds a
Batch, which this suite does not read'). A named tuple or dataclass is read back as its class, found in its module
among those the check imported; one a reference cannot hold is refused by ``record``'s pre-flight, nothing trained
and nothing written."""

import collections
import dataclasses
import typing

import flax.struct
import jax
import numpy as np
import pytest
from conftest import require_devices
from hostile_ports import LOOP, old

from equivalence.core import harness
from equivalence.core.port.config import RunConfig
from equivalence.core.preflight import PreflightError
from equivalence.core.reference import reference
from equivalence.core.reference.referenced import TYPES

CONFIG = {'devices': 2, 'steps_per_call': 1, 'calls': 1, 'batch_size': 8, 'rng_mode': 'global'}


class Rays(typing.NamedTuple):
    origins: np.ndarray
    directions: np.ndarray


@flax.struct.dataclass
class RayBatch:  # a NeRF codebase's batch: its rays, and the colour each should render
    rays: Rays
    rgb: np.ndarray


class Batch(typing.NamedTuple):  # the example's (x, y), as upstream's own class: its steps unpack it as before
    x: np.ndarray
    y: np.ndarray


@jax.tree_util.register_pytree_node_class
class Registered:  # a pytree of its own flatten functions
    def __init__(self, x, y):
        self.x, self.y = x, y

    def tree_flatten(self):
        return (self.x, self.y), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def test_a_batch_of_its_own_classes_is_read_back_as_those_classes(tmp_path):
    """A ``flax.struct.dataclass`` holding a ``NamedTuple``, as a reference keeps a call's batch: read back as the
    same classes and arrays. A class whose module this process has not imported is refused saying which to import."""
    batch = RayBatch(rays=Rays(np.ones((2, 3), np.float32), np.zeros((2, 3), np.float32)), rgb=np.arange(6.0))
    path = str(tmp_path / 'batch.npz')
    reference.save(path, RunConfig(**CONFIG), 'nerf', {'calls': [batch]})
    [back] = reference.load(path).content(TYPES)['calls']
    assert type(back) is RayBatch and type(back.rays) is Rays, back
    assert jax.tree.all(jax.tree.map(np.array_equal, back, batch))
    elsewhere = collections.namedtuple('Batch', ['x'], module='upstream_train')  # a module not imported here
    reference.save(path, RunConfig(**CONFIG), 'nerf', {'calls': [elsewhere(np.ones(2))]})
    with pytest.raises(reference.BadReference) as refused:
        reference.load(path).content(TYPES)
    assert str(refused.value) == (
        f'reference {path}: holds a Batch (upstream_train.Batch), which this process has not imported: import '
        "upstream_train in the port's module"
    )


def test_record_reads_a_namedtuple_batch_back_and_refuses_one_it_cannot_before_training(tmp_path):
    """The example's loop port, its batch upstream's ``Batch`` NamedTuple: recorded, then checked against the
    reference (MATCH). A batch that a reference cannot hold (a pytree of its own flatten functions, a class
    defined inside a function) is ``record``'s pre-flight line naming ``make_data`` and the fix; nothing written."""
    require_devices(2)
    port = dataclasses.replace(LOOP, make_data=lambda *a: Batch(*old.make_data(*a)))
    path = str(tmp_path / 'batch.npz')
    harness.record(port, RunConfig(workload=port.name, **CONFIG), path)
    assert harness.check(port, reference=path, verdict='screen').report.match

    def local_batch(*args):
        class Local(typing.NamedTuple):
            x: np.ndarray
            y: np.ndarray

        return Local(*old.make_data(*args))

    refused = str(tmp_path / 'refused.npz')
    for make_data, said in (
        (lambda *a: Registered(*old.make_data(*a)), 'returns batches holding a test_reference_batches.Registered, a '
         'pytree of its own flatten functions, which a reference cannot hold: make it a dataclass'),
        (local_batch, 'returns batches that a check could not read back from a reference: it holds a Local defined '
         'inside a function (test_record_reads_a_namedtuple_batch_back_and_refuses_one_it_cannot_before_training.'
         '<locals>.local_batch.<locals>.Local): define it at the top level of test_reference_batches'),
    ):  # fmt: skip
        bad = dataclasses.replace(LOOP, make_data=make_data)
        with pytest.raises(PreflightError) as e:
            harness.record(bad, RunConfig(workload=bad.name, **CONFIG), refused)
        assert str(e.value).startswith(f"port 'mlp-port-loop': make_data {said}"), str(e.value)
        assert not (tmp_path / 'refused.npz').exists()
