"""Each configuration class runs its own copy of the hot methods it inherits.

CPython (3.11 on) specializes each bytecode instruction for the types it meets: an attribute read
becomes a read at a fixed slot of one class, a method call a call of one function. A method that
several configurations inherit meets all their types at the same instructions (the live cache's
nodes and the tuner's shadows' nodes are different classes, served through the same `TreeCore`
code), its specializations keep missing and it runs the generic, slower lookups. A class that
names a method in its hot list gets, at its creation, a copy of the inherited function: the same
source, globals, defaults and closure, in a new code object, whose instructions specialize for
that class's types alone. The copies behave exactly as the original; only CPython's caches differ.

Consequence for tests that replace a hot method (a mutant): replace it on the class under test
(each class holds its own copy), not on the class it was copied from.
"""

from __future__ import annotations

import types


def origin(func):
    """The function `func` was copied from (`func` itself if it is no copy)."""
    return getattr(func, "_copy_of", func)


def copy_function(func: types.FunctionType) -> types.FunctionType:
    """`func` with its own code object (and so its own specializations)."""
    source = origin(func)
    copy = types.FunctionType(source.__code__.replace(), source.__globals__, source.__name__, source.__defaults__,
                              source.__closure__)
    copy.__kwdefaults__ = source.__kwdefaults__
    copy.__qualname__, copy.__doc__, copy.__module__ = source.__qualname__, source.__doc__, source.__module__
    copy.__annotations__ = source.__annotations__
    copy._copy_of = source
    return copy


def own_copies(cls: type, names) -> None:
    """Give `cls` its own copy of each method in `names` that it inherits (one it defines is its own)."""
    for name in names:
        if name in cls.__dict__:
            continue
        inherited = getattr(cls, name, None)
        if isinstance(inherited, types.FunctionType):
            setattr(cls, name, copy_function(inherited))
