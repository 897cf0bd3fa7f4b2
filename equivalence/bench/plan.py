"""What the bench times of a port, asked of its kind (``kind.asked(plan)``): a model port's variants are the
suite's own loops over its two models (``model_port``); a loop port's are its own pmap step and new call,
with the forms of its call the suite can derive beside them (``loop_port``)."""

import dataclasses

from equivalence.bench import loop, variants
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import Port


@dataclasses.dataclass(frozen=True)
class Plan:
    port: Port
    config: Run
    feed: variants.Feed
    k_scaling: int
    strategy_configs: tuple = ()

    def model_port(self) -> tuple[list[variants.Variant], list[str]]:
        """``(the variants, what could not be built)``: every variant of ``variants.build_model``."""
        built = variants.build_model(self.port, self.config, self.feed, self.k_scaling, self.strategy_configs)
        return built, []

    def loop_port(self) -> tuple[list[variants.Variant], list[str]]:
        """``(the variants, what could not be derived)``: its two sides (``variants.build_loop``), the derived
        forms of its call (``loop.derive``) beside its call at K."""
        built = variants.build_loop(self.port, self.config, self.feed, self.k_scaling)
        derived = loop.derive(self.port, self.config, self.feed)
        built[2:2] = derived.variants
        return built, derived.notes
