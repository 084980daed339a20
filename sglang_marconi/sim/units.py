"""Values as users write them on the command line: byte sizes (2GB = 10^9 bytes, 2GiB = 2^30,
500MB, 1.5TB, or plain bytes), counts (`1000,5000`) and `key=value,...` parameter lists."""

from __future__ import annotations

import re

from sglang_marconi.policy.errors import MarconiError

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    match = _PATTERN.match(text)
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS:
        raise MarconiError(f"cannot read capacity {text!r}: use a number with GB (10^9 bytes), GiB (2^30), MB, MiB, TB or no unit")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise MarconiError(f"capacity {text!r} must be positive")
    return value


def parse_capacities(text: str) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise MarconiError(f"no capacity given in {text!r}")
    return [parse_bytes(t) for t in items]


def parse_host_capacities(text: str) -> list[int]:
    """`--host-capacity`: byte sizes as `parse_capacities`, where 0 means no host tier."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise MarconiError(f"no host capacity given in {text!r}")
    return [0 if _PATTERN.match(t) and float(_PATTERN.match(t).group(1)) == 0 else parse_bytes(t) for t in items]


def parse_counts(text: str, what: str = "capacity") -> list[int]:
    """A comma list of positive integers, e.g. block counts `1000,5000`."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise MarconiError(f"no {what} given in {text!r}")
    out = []
    for item in items:
        try:
            value = int(item)
        except ValueError:
            raise MarconiError(f"cannot read {what} {item!r}: expected a whole number") from None
        if value <= 0:
            raise MarconiError(f"{what} {item!r} must be positive")
        out.append(value)
    return out


def parse_params(what: str, text: str, schema: dict[str, type]) -> dict[str, int | float]:
    """`key=value,...` (`text`, may be empty) read by `schema` (key -> int or float); errors name
    `what` (e.g. "workload spec 'synthetic:lmsys:...'"), the key and the bad value."""
    kwargs: dict[str, int | float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        if not eq:
            raise MarconiError(f"{what}: expected key=value, got {item!r}")
        if key not in schema:
            raise MarconiError(f"{what}: unknown parameter {key!r}; known: {list(schema)}")
        try:
            kwargs[key] = schema[key](value)
        except ValueError:
            kind_name = {int: "an integer", float: "a number"}[schema[key]]
            raise MarconiError(f"{what}: parameter {key!r} needs {kind_name}, got {value!r}") from None
    return kwargs


def format_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"
