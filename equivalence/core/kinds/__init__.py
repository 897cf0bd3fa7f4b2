"""One object per kind of port (``core.port.kind``): a model port (``model.Model``), a loop port's fused
call (``loop.FusedLoop``) and a loop port's step form (``loop.StepLoop``). ``of(port)`` builds the one for
a port; everything the suite asks of a port's kind (its setups, its twin's, its pre-flight, how it is
described, what its first step shows) is asked of that object, so no other room asks the port's class.

May import: every room below it but ``judge`` and ``reference`` (it builds what they run; they are handed it).
"""

from equivalence.core.kinds.loop import FusedLoop, StepLoop
from equivalence.core.kinds.model import Model
from equivalence.core.port.kind import Form, Kind, form_of
from equivalence.core.port.ports import Port

CLASSES = {Form.MODEL: Model, Form.FUSED: FusedLoop, Form.STEP: StepLoop}

__all__ = ['CLASSES', 'FusedLoop', 'Kind', 'Model', 'StepLoop', 'of']


def of(port: Port) -> Kind:
    """The object of ``port``'s kind (``core.port.kind.form_of`` decides which)."""
    return CLASSES[form_of(port)](port)
