"""What we rely on in SGLang, as `third_party/README.md`'s table lists it, and the check that an
installed SGLang still provides it: names, signatures, and the keyword arguments our hooks read.

The table ("SGLang names and signatures we rely on") has one row per name:
`| `dotted name` | kind | `signature` or - | used by | for |`. Kinds:
- `method`, `function`: looked up on its class / module; with a signature, the parameters of its
  definition in SGLang's source must be exactly those (names, kinds, which have defaults);
- `class`, `class attribute`: looked up on the owner;
- `instance`: an attribute SGLang sets in `__init__`, looked up on an instance built on CPU;
- `walk state`, `memo`, `set by SGLang`: set by SGLang after `__init__`, so SGLang's source must still
  assign it (`.name =`);
- `kwarg`: the name is `dotted.method(key=)`: our hook reads `kwargs["key"]`, so the parameter
  must still exist and every call of the method in SGLang's source must pass `key=` by keyword.

Signatures are read from SGLang's source (AST), never from the live function, which a hook or a
CPU stand-in of the test process may have replaced. `check` runs against any package laid out
as SGLang (`package` names it), so a test can run it on a fake.

`python tests/serving/sglang_surface.py` prints each listed method's signature in the installed
SGLang, next to the table's (for re-pinning).
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

README = Path(__file__).resolve().parents[2] / "third_party" / "README.md"
KWARG = re.compile(r"^(sglang[\w.]+)\((\w+)=\)$")
SOURCE_KINDS = ("walk state", "memo", "set by SGLang")


@dataclass(frozen=True)
class Row:
    name: str  # dotted, as SGLang spells it (`sglang.`...), or `dotted.method(key=)` for a kwarg
    kind: str
    signature: Optional[str]  # `(self, a, *, b=...)`, or None
    used_by: str

    @property
    def attr(self) -> str:
        m = KWARG.match(self.name)
        return (m.group(1) if m else self.name).rsplit(".", 1)[1]


def parse_table(text: str) -> list[Row]:
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `sglang."):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5:
            raise ValueError(f"third_party/README.md: a row needs 5 cells, got {len(cells)}: {line}")
        name, kind, signature, used_by, _ = cells
        sig = None if signature == "-" else signature.strip("`")
        rows.append(Row(name.strip("`"), kind, sig, used_by))
    return rows


def listed() -> list[Row]:
    return parse_table(README.read_text())


# -- signatures ----------------------------------------------------------------------------------

_NO_DEFAULT = inspect.Parameter.empty
_HAS_DEFAULT = "..."


def signature_from_ast(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> inspect.Signature:
    a, P = fn.args, inspect.Parameter
    params = []
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    for i, arg in enumerate(positional):
        kind = P.POSITIONAL_ONLY if i < len(a.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=_HAS_DEFAULT if i >= first_default else _NO_DEFAULT))
    if a.vararg:
        params.append(P(a.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        params.append(P(arg.arg, P.KEYWORD_ONLY, default=_NO_DEFAULT if default is None else _HAS_DEFAULT))
    if a.kwarg:
        params.append(P(a.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def render(sig: inspect.Signature) -> str:
    """`(self, a, b=..., /, c, *, d, **kw)` style: names, kinds, and which have defaults (not their values)."""
    P, out, star = inspect.Parameter, [], False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is P.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        if p.kind is P.VAR_POSITIONAL:
            out.append(f"*{p.name}")
            star = True
        elif p.kind is P.VAR_KEYWORD:
            out.append(f"**{p.name}")
        else:
            out.append(p.name + ("=..." if p.default is not P.empty else ""))
        if p.kind is P.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind is not P.POSITIONAL_ONLY):
            out.append("/")
    return "(" + ", ".join(out) + ")"


@functools.lru_cache(maxsize=None)
def _module_ast(path: str) -> ast.Module:
    return ast.parse(Path(path).read_text(errors="replace"))


def _def_in(tree_body, name):
    for node in tree_body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
    return None


def source_signature(owner, attr: str) -> Optional[inspect.Signature]:
    """The signature of `owner.attr` as SGLang's source defines it (the class in `owner`'s MRO
    that defines it, or the module), or None if no definition is found in source."""
    if inspect.ismodule(owner):
        fn = _def_in(_module_ast(owner.__file__).body, attr)
        return signature_from_ast(fn) if fn is not None else None
    for klass in inspect.getmro(owner):
        if attr not in klass.__dict__:
            continue
        try:
            path = inspect.getsourcefile(klass)
        except TypeError:
            return None
        for node in ast.walk(_module_ast(path)):
            if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
                fn = _def_in(node.body, attr)
                if fn is not None:
                    return signature_from_ast(fn)
        return None
    return None


# -- the check -------------------------------------------------------------------------------------

class _Source:
    """The `.py` files of a package, read once, parsed on demand."""

    def __init__(self, root: Path):
        self.files = {p: p.read_text(errors="replace") for p in sorted(root.rglob("*.py"))}

    def assigns(self, attr: str) -> bool:
        pattern = re.compile(rf"\.{re.escape(attr)}\s*(?::[^=\n]+)?=(?!=)")
        return any(pattern.search(text) for text in self.files.values())

    def calls(self, method: str):
        """Every call `<anything>.method(...)` in the package: (path, ast.Call)."""
        needle = f".{method}("
        for path, text in self.files.items():
            if needle not in text and f".{method}\n" not in text:
                continue
            for node in ast.walk(_module_ast(str(path))):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method:
                    yield path, node


def _resolve(dotted: str):
    owner_path, attr = dotted.rsplit(".", 1)
    return pkgutil.resolve_name(owner_path), attr


def check(rows: list[Row], package: str = "sglang", instances: Optional[dict] = None) -> list[str]:
    """One line per way the installed `package` (SGLang, or a fake laid out as it) no longer
    provides what `rows` list. Empty when all is there."""
    root = Path(importlib.import_module(package).__file__).parent
    source = _Source(root)
    problems = []

    def local(name: str) -> str:
        return package + name[len("sglang"):]

    for row in rows:
        m = KWARG.match(row.name)
        dotted = local(m.group(1) if m else row.name)
        try:
            owner, attr = _resolve(dotted)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{row.name}: its owner is gone ({exc})")
            continue
        if m:
            problems += _check_kwarg(row, owner, attr, m.group(2), source)
            continue
        if row.kind == "instance":
            target = (instances or {}).get(owner.__name__)
            if target is None:
                problems.append(f"{row.name}: no {owner.__name__} instance to look it up on")
            elif not hasattr(target, attr) and attr not in getattr(target, "__dict__", {}):
                problems.append(f"{row.name}: missing on a {owner.__name__} instance")
        elif row.kind in SOURCE_KINDS:
            if not source.assigns(attr):
                problems.append(f"{row.name}: {package}'s source no longer assigns .{attr}")
        elif not hasattr(owner, attr):
            problems.append(f"{row.name}: missing")
        elif row.signature is not None:
            sig = source_signature(owner, attr)
            if sig is None:
                problems.append(f"{row.name}: no definition found in {package}'s source")
            elif render(sig) != row.signature:
                problems.append(f"{row.name}: signature is {render(sig)}, the table (and our code) expects {row.signature}")
    return problems


def _check_kwarg(row: Row, owner, method: str, key: str, source: _Source) -> list[str]:
    P = inspect.Parameter
    sig = source_signature(owner, method)
    if sig is None:
        return [f"{row.name}: no definition of {method} found in the source"]
    param = sig.parameters.get(key)
    if param is None or param.kind not in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY):
        return [f"{row.name}: {method}{render(sig)} takes no keyword {key}"]
    calls = list(source.calls(method))
    if not calls:
        return [f"{row.name}: no call of .{method}( left in the source"]
    out = []
    for path, call in calls:
        if not any(k.arg == key or k.arg is None for k in call.keywords):  # k.arg None: **kwargs
            out.append(f"{row.name}: {path.name}:{call.lineno} calls .{method}( without {key}= "
                       "(our hook reads it from kwargs)")
    return out


# -- our side: what our code expects ---------------------------------------------------------------

def calls_for(sig: inspect.Signature, skip_first: bool = True):
    """The argument shapes a caller may use with `sig`: (args, kwargs) with every parameter
    positional where it can be, every one by keyword where it can be, and the required ones only."""
    P = inspect.Parameter
    params = [p for p in sig.parameters.values() if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    if skip_first and params and params[0].kind is not P.KEYWORD_ONLY:
        params = params[1:]  # self / cls: the hook or override gets it as SGLang passes it
    shapes = []
    for required_only in (False, True):
        use = [p for p in params if not required_only or p.default is P.empty]
        positional = [p.name for p in use if p.kind is not P.KEYWORD_ONLY]
        keyword = [p.name for p in use if p.kind is P.KEYWORD_ONLY]
        shapes.append((positional, keyword))
        by_name = [p.name for p in use if p.kind is P.POSITIONAL_ONLY]
        shapes.append((by_name, [p.name for p in use if p.kind is not P.POSITIONAL_ONLY]))
    return shapes


def accepts(ours: inspect.Signature, theirs: inspect.Signature, leading: int) -> list[str]:
    """How `ours` (an override, or a hook with `leading` extra first arguments: the original
    function for AROUND, the result for AFTER, plus self) fails to take every call SGLang's
    `theirs` allows. Empty when it takes them all."""
    problems = []
    for positional, keyword in calls_for(theirs):
        try:
            ours.bind(*(["x"] * leading), *positional, **{k: k for k in keyword})
        except TypeError as exc:
            problems.append(f"a call with {positional} positional and {keyword} by keyword: {exc}")
    return problems


def kwargs_keys_read(fn) -> set[str]:
    """Keys `fn` reads from its `**kwargs`: `kwargs.get("k")`, `kwargs["k"]`, `"k" in kwargs`."""
    fn = inspect.unwrap(fn)
    var_kw = next((p.name for p in inspect.signature(fn).parameters.values()
                   if p.kind is inspect.Parameter.VAR_KEYWORD), None)
    if var_kw is None:
        return set()
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    keys = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == var_kw
                and node.args and isinstance(node.args[0], ast.Constant)):
            keys.add(node.args[0].value)
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == var_kw
              and isinstance(node.slice, ast.Constant)):
            keys.add(node.slice.value)
        elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
              and any(isinstance(c, ast.Name) and c.id == var_kw for c in node.comparators)):
            keys.add(node.left.value)
    return keys


if __name__ == "__main__":
    for row in listed():
        if row.signature is None and row.kind not in ("method", "function"):
            continue
        owner, attr = _resolve(KWARG.match(row.name).group(1) if KWARG.match(row.name) else row.name)
        sig = source_signature(owner, attr)
        now = render(sig) if sig is not None else "?"
        flag = "" if now == row.signature else "   <- differs"
        print(f"{row.name}  {now}{flag}", file=sys.stdout)
