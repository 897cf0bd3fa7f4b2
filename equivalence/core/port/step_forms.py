"""A loop port's step form, decided once (``of``): how its step takes its key, as one object per form
that answers what the adapters (``run.adapters``), the step setups (``run.step_side``) and the pre-flight
(``preflight.steps``) ask, so that none of them reads ``step_form`` again.

- ``Carry``: ``step((rng, state), batch) -> ((rng, state), out)``: the key chain is the scan's carry;
- ``State``: ``step(state, batch) -> (state, out)``: no key, or the key inside the state;
- ``StateRng``: ``step(state, batch, key) -> (state, out)``: every step a fresh key from the host chain.
"""

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from equivalence.core.port.config import ConfigError
from equivalence.core.port.port_fields import rng_call


class StepForm:
    """What every form answers; the keyed forms (``Carry``, ``StateRng``) share the key's handling."""

    name = ''
    signature = ''  # how the step is called, for the report's line
    expected = ''  # what the step returns, for the pre-flight's line
    default_loop = 'steps'  # the pmap side's loop where the port names none

    def check_loop(self, loop: str, where: str) -> None:
        """``ConfigError`` where the pmap side's loop cannot run this form."""

    def check_new_step(self, port: Any, where: str) -> None:
        """``ConfigError`` where this form cannot take a ``new_step``."""

    def key_draws_per_call(self, k: int) -> int:
        """How many times one call of K steps draws from the host key chain (``adapters.chain_at``)."""
        raise NotImplementedError

    def keys(self, next_keys: Callable, rng: jax.Array, n: int, mode: str, k: int) -> tuple[jax.Array, Any]:
        """``(the host chain after one call, the keys that call hands its steps, or None)``."""
        raise NotImplementedError

    def legacy_keys(self, keys: Any) -> Any:
        """The pmap side's keys of one call (``keys``' second), stacked as its program takes them: ``[D, ...]``."""
        return keys

    def program(self, carried: Callable[[], Any], stepped: Callable[[], Any]) -> Any:
        """What a side runs: ``stepped()`` (a step at a time, or scanned), or ``carried()`` where the key chain
        is the scan's carry."""
        return stepped()

    def one_step(self, step: Callable, port: Any) -> Callable:
        """``(state, batch, key) -> (state, out)`` from the team's step."""
        raise NotImplementedError

    def new_rng_keyword(self, port: Any) -> str | None:
        """The keyword ``new_step`` takes its key by, or None (third, or no key)."""
        return None

    def new_step_call(self, port: Any) -> Callable:
        """``(train_state, batch, key) -> whatever new_step returns``: the key by keyword or third."""
        keyword = self.new_rng_keyword(port)
        if keyword:
            return lambda ts, batch, key: port.new_step(ts, batch, **{keyword: key})
        return lambda ts, batch, key: port.new_step(ts, batch, key)

    def new_step_text(self, keyword: str | None) -> tuple[str, str]:
        """``(the key in new_step's call, a hint)`` for the pre-flight's line."""
        hint = '' if keyword else " (new_rng_arg='dropout_rng' passes it by keyword)"
        return (f', {keyword}=key' if keyword else ', key'), hint

    def fused_keys(self, key: Any, k: int) -> Any:
        """What a fused ``new_call`` is handed as its keys, abstractly, from one call's ``key``."""
        return key


class Carry(StepForm):
    name, signature, default_loop = 'carry', '((rng, state), batch)', 'scan'
    expected = '((rng, state), batch) -> ((rng, state), out)'

    def check_loop(self, loop: str, where: str) -> None:
        if loop != 'scan':
            raise ConfigError(f"{where}: a 'carry' step returns its key chain: it runs under scan (legacy_loop='scan')")

    def check_new_step(self, port: Any, where: str) -> None:
        if port.new_step is not None:
            raise ConfigError(
                f"{where}: new_step takes step_form 'state' or 'state_rng'; a 'carry' port gives new_call"
            )

    def key_draws_per_call(self, k: int) -> int:
        return 1

    def keys(self, next_keys: Callable, rng: jax.Array, n: int, mode: str, k: int) -> tuple[jax.Array, Any]:
        return next_keys(rng, n, mode)

    def program(self, carried: Callable[[], Any], stepped: Callable[[], Any]) -> Any:
        return carried()

    def one_step(self, step: Callable, port: Any) -> Callable:
        return lambda state, batch, key: _carry_step(step, state, batch, key)


def _carry_step(step: Callable, state, batch, key):
    (_, state), out = step((key, state), batch)
    return state, out


class State(StepForm):
    name, signature = 'state', '(state, batch)'
    expected = '(state, batch) -> (state, out)'

    def key_draws_per_call(self, k: int) -> int:
        return 0

    def keys(self, next_keys: Callable, rng: jax.Array, n: int, mode: str, k: int) -> tuple[jax.Array, Any]:
        return rng, None

    def one_step(self, step: Callable, port: Any) -> Callable:
        return lambda state, batch, key: step(state, batch)

    def new_step_call(self, port: Any) -> Callable:
        return lambda ts, batch, key: port.new_step(ts, batch)

    def new_step_text(self, keyword: str | None) -> tuple[str, str]:
        return '', ''

    def fused_keys(self, key: Any, k: int) -> None:
        return None


class StateRng(StepForm):
    name, signature = 'state_rng', '(state, batch, rng)'
    expected = '(state, batch, rng) -> (state, out)'

    def key_draws_per_call(self, k: int) -> int:
        return k

    def keys(self, next_keys: Callable, rng: jax.Array, n: int, mode: str, k: int) -> tuple[jax.Array, list]:
        """K keys from the host chain, one per step, each drawn as one call's keys are (``next_call_keys``)."""
        keys = []
        for _ in range(k):
            rng, key = next_keys(rng, n, mode)
            keys.append(key)
        return rng, keys

    def legacy_keys(self, keys: list) -> jax.Array:
        return jnp.stack(keys, axis=1)  # [D, K, 2]

    def one_step(self, step: Callable, port: Any) -> Callable:
        how, names = rng_call(port)
        if how == 'first':
            return lambda state, batch, key: step(key, state, batch)
        if how == 'names':  # every argument by its name: the key's, and the state's and batch's (rng_call)
            return lambda state, batch, key: step(**{port.rng_arg: key, names[0]: state, names[1]: batch})
        if port.rng_arg:
            return lambda state, batch, key: step(state, batch, **{port.rng_arg: key})
        return step

    def new_rng_keyword(self, port: Any) -> str | None:
        """``new_rng_arg``; else ``rng_arg`` where the new step has a parameter of that name that is not its
        third positional one (upstream calls it ``dropout_rng`` on both sides, and ``functools.partial``
        binding the arguments before it leaves it keyword-only); else None, the third positional argument (a
        ``jax.jit`` with ``in_shardings`` takes no keyword arguments)."""
        if port.new_step is None:
            return None
        if port.new_rng_arg:
            return port.new_rng_arg
        positional, names = _parameters(port.new_step)
        if port.rng_arg and port.rng_arg in names and positional[2:3] != [port.rng_arg]:
            return port.rng_arg
        return None

    def fused_keys(self, key: Any, k: int) -> Any:
        return jax.ShapeDtypeStruct((k, *key.shape), key.dtype)  # one key per step, stacked


def _parameters(fn: Callable) -> tuple[list[str], set[str]]:
    """``(positional parameter names, all parameter names)`` of ``fn``'s signature; none when it has none."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a callable with no signature to read: it takes the key positionally
        return [], set()
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p.name for p in params if p.kind in kinds], {p.name for p in params}


FORMS = {form.name: form for form in (Carry(), State(), StateRng())}


def of(port: Any) -> StepForm:
    """A loop port's step form: ``ConfigError`` (exit 2) naming the choices where it is none of them."""
    form = FORMS.get(port.step_form)
    if form is None:
        raise ConfigError(f'port {port.name!r}: step_form {port.step_form!r} is not one of {", ".join(FORMS)}')
    return form
