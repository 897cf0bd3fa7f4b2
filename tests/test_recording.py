"""The first step recorded module by module agrees with itself on a correct port, whatever the form of
its forward pass (issue 40): plain; vmapped over each device's rows (``nnx.vmap``); a block under
``nnx.remat``; stacked blocks under ``nnx.scan`` against linen's ``nn.scan``; and the linen network
itself inside ``nnx.bridge.ToNNX``. Every linen module call is paired and agrees, and nothing is
located; the negative control, one LayerNorm epsilon in the same form, is located at that LayerNorm.
Recorded before the fix, the vmapped form named a place on the correct port (each device's rows
recorded in no fixed order, one kept), and the scanned one named the code feeding the second block."""

import functools

import pytest
import recording_forms as forms
from conftest import require_devices

from equivalence.core import harness, kinds, preflight
from equivalence.core.port.config import RunConfig
from equivalence.core.run import inputs as made
from equivalence.core.verdict import locate
from equivalence.core.verdict.first_step import Recorder


def located(port) -> locate.Location:
    require_devices(forms.DEVICES)
    config = RunConfig(workload=port.name, devices=forms.DEVICES, steps_per_call=1, calls=1, batch_size=8,
                       rng_mode=port.rng_modes[0], available=forms.DEVICES)  # fmt: skip
    kind = kinds.of(port)
    fed = made.make(port, config, preflight.check(kind, config))
    return locate.locate(kind, config, fed, Recorder(kind, config, fed, 1))


@functools.cache
def checked_vmap():
    """The vmapped form's whole check, located on MATCH (``locate=True``): its location is the form's correct one."""
    require_devices(forms.DEVICES)
    return harness.check(forms.port('vmap'), devices=forms.DEVICES, steps_per_call=1, calls=1, locate=True)


@pytest.mark.parametrize('form', forms.FORMS)
def test_each_form_of_the_forward_pass_is_recorded_as_it_ran(form):
    # the vmapped form's correct port: located by its whole check (the test below), as the verdict records it
    correct = checked_vmap().verdict.location if form == 'vmap' else located(forms.port(form))
    assert correct.kind == 'none' and not correct.notes, correct.lines()  # every call paired (no note)
    assert len(correct.modules) == 6 and all(m.input_ok and m.output_ok for m in correct.modules), correct.modules
    slip = located(forms.port(form, epsilon=1e-2))
    assert (slip.kind, slip.new.rpartition('/')[2]) == ('module', 'norm'), slip.line()
    before = slip.modules[: slip.first]
    assert before and all(m.input_ok and m.output_ok for m in before), slip.lines()


def test_the_vmapped_forward_recorded_reproduces_its_run_and_locates_nothing_on_match():
    """Through the whole check (``locate=True``): the recording's first losses are the run's (a recording
    that did not reproduce them would name no place), and the MATCH is located nowhere, every module call
    paired and agreeing (the test above reads the same location)."""
    result = checked_vmap()
    assert result.outcome.label == 'MATCH' and result.verdict.location.kind == 'none', result.verdict.lines()
