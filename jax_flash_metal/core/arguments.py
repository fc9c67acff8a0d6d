"""Single arguments as the checks take them: array-likes, bools and static reals, each with a
TypeError naming the argument."""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np


def is_jax(x):
    """A JAX array, a tracer (tracers are jax.Array instances) or a JAX-convertible object."""
    return isinstance(x, jax.Array) or hasattr(x, "__jax_array__")


def array_like(x, name, asarray):
    """``asarray(x)`` for every array-like ``jnp.asarray`` takes, as jax.nn does (JAX and NumPy
    arrays, nested lists, scalars); TypeError naming ``name`` for anything else."""
    try:
        return asarray(x)
    except (TypeError, ValueError, OverflowError) as e:
        raise TypeError(f"{name} must be an array-like (a JAX or NumPy array, a nested list or a "
                        f"scalar), got {type(x).__name__}: {e}") from None


def as_array(x, name):
    return x if isinstance(x, jax.Array) else array_like(x, name, jnp.asarray)


def check_bool(value, name):
    """``value`` as a Python bool known at trace time: a Python or NumPy bool, the integer 0 or
    1, or a concrete 0-d bool or integer JAX/NumPy array holding one of them (the flags jax.nn
    tests with ``if``). TypeError naming ``name`` otherwise, and for a traced value (a flag
    selects the computation, so it is static)."""
    problem = ""
    if isinstance(value, (jax.Array, np.ndarray)) and value.shape == () and (
            value.dtype == np.bool_ or jnp.issubdtype(value.dtype, jnp.integer)):
        try:
            value = int(value)
        except jax.errors.ConcretizationTypeError:
            problem = " (a traced value: pass a Python bool, or make the argument static)"
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, numbers.Integral)
                                               and value in (0, 1)):
        return bool(value)
    raise TypeError(f"{name} must be a bool known at trace time{problem}, got {value!r} of type "
                    f"{type(value).__name__}")


def static_real(value, name):
    """A Python float from a real Python/NumPy number or a concrete real JAX/NumPy scalar
    array (as jax.nn accepts for ``scale``); TypeError naming ``name`` otherwise."""
    problem = None
    if isinstance(value, (jax.Array, np.ndarray)):
        real = jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype,
                                                                            jnp.integer)
        if value.shape == () and real:
            try:
                return float(value)
            except jax.errors.ConcretizationTypeError:
                problem = "a traced array"
    elif isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    raise TypeError(
        f"{name} must be a real number known at trace time (Python, NumPy or a concrete JAX "
        f"scalar{'' if problem is None else ', not ' + problem}), got {value!r} of type "
        f"{type(value).__name__}"
    )
