"""A line of the report that is also a value (``Line``): its text as the report and the JSON say it, its
fields as attributes that a program and the tests read (``states.Uncompared``, ``adapters.Ran``,
``adapters.Wrapped``)."""

from typing import Any, ClassVar


class Line(str):
    """``text``, with the values ``FIELDS`` names as attributes; pickled and copied as made."""

    FIELDS: ClassVar[tuple[str, ...]] = ()

    def __new__(cls, text: str, *values: Any):
        line = super().__new__(cls, text)
        for name, value in zip(cls.FIELDS, values, strict=True):
            setattr(line, name, value)
        return line

    def __reduce__(self):
        return _remade, (type(self), str(self), {name: getattr(self, name) for name in self.FIELDS})


def _remade(cls: type, text: str, fields: dict) -> 'Line':
    line = str.__new__(cls, text)
    line.__dict__.update(fields)
    return line
