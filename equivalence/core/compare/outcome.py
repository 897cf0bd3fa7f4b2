"""The product of a check, as one value: MATCH, MISMATCH or NOT VERIFIED, each with its exit code.

Decided once, by the verdict (``judge``, into ``rule.Verdict.outcome``); ``run``, the corpus, the pytest plugin and the
report read it and derive nothing themselves. Imports nothing heavy: the command layer reads the exit
codes before JAX starts.
"""

import enum


class Outcome(enum.Enum):
    """What a check says of a port, and the exit code ``python -m equivalence.run`` ends with."""

    MATCH = 0  # every leaf within its floor, the counters equal: the port trains the same model
    MISMATCH = 1  # some leaf outside its floor: it does not
    NOT_VERIFIED = 5  # every leaf within its floor, but too much of it is noise (or no floor was measured)

    @property
    def exit_code(self) -> int:
        return self.value

    @property
    def label(self) -> str:
        """How a report names it: 'MATCH', 'MISMATCH', 'NOT VERIFIED'."""
        return self.name.replace('_', ' ')

    @classmethod
    def of(cls, match: bool) -> 'Outcome':
        """MATCH or MISMATCH: the outcome of a comparison whose leaves ``match`` (or not). NOT VERIFIED is the
        verdict's own (``verdict.unverified``), set with its typed reason."""
        return cls.MATCH if match else cls.MISMATCH
