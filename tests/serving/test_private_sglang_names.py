"""Everything we rely on in SGLang (third_party/README.md, "SGLang names and signatures we rely
on") still holds in the installed SGLang, and everything our code relies on is in that table:
private names used anywhere in the package, tests and scripts, the methods our SGLang subclasses
override, the HookRegistry targets we hook and the `kwargs` keys those hooks read.
The check itself is shown failing on fake SGLangs in `test_sglang_surface_check.py`."""

import ast
import inspect
import re
from pathlib import Path
from types import FunctionType

import pytest

pytest.importorskip("sglang")

from sglang_surface import KWARG, accepts, check, kwargs_keys_read, listed, render, source_signature  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
OUR_CODE = ("sglang_marconi", "tests", "scripts")
# These two files spell fake SGLang names (the check's own tests).
NOT_SCANNED = {"tests/serving/test_sglang_surface_check.py", "tests/serving/test_private_sglang_names.py"}
# Private names our code uses that are not SGLang's, though SGLang's source defines the same name.
NOT_SGLANG = {
    "_replace": "NamedTuple._replace (Python's), on SGLang's match result",
    "_exit": "os._exit",
}
# Names we define ourselves that an SGLang module we import also defines: ours where we use them.
OWN = {
    "_bind": "serving/tree_index.py",
    "_delete_leaf": "policy/tree/served_cache.py",
    "_is_device_leaf": "policy/tree/tiered_cache.py",
    "_key": "policy/ (radix tree, caches)",
    "_new_node": "policy/ (radix tree, caches)",
    "_profile": "scripts/bench_sglang_cache.py",
    "_read": "serving/shared_ring.py",
    "_rows": "policy/tuning/evidence.py",
    "_set": "serving/tree_index.py",
    "_thread": "tests/server/port_forward.py",
}
DOTTED = re.compile(r"^sglang(\.\w+)+$")
DEFINES = re.compile(r"(?:def\s+|class\s+|\.|^[ \t]*)(_[A-Za-z]\w*)\s*(?:[(:]|=(?!=))", re.M)


def instances():
    """SGLang objects built on CPU, by class name: where attributes set in `__init__` live."""
    from sglang_cpu import build_cache
    from sglang.srt.server_args import ServerArgs

    cc = build_cache()
    return {"UnifiedTreeCore": cc.cache.tree_core, "UnifiedRadixCache": cc.cache,
            "ServerArgs": ServerArgs(model_path="dummy")}


def listed_attrs() -> set[str]:
    return {row.attr for row in listed()}


def listed_names() -> set[str]:
    return {row.name for row in listed()}


def test_the_table_parses_and_names_every_kind():
    rows = listed()
    assert len(rows) >= 80
    assert {r.kind for r in rows} >= {"method", "function", "instance", "class", "class attribute", "walk state",
                                      "memo", "set by SGLang", "kwarg"}
    for row in rows:
        assert (row.signature is not None) == (row.kind in ("method", "function")), row.name
        assert (KWARG.match(row.name) is not None) == (row.kind == "kwarg"), row.name
    assert len({r.name for r in rows}) == len(rows), "a name listed twice"


def test_every_listed_name_signature_and_kwarg_holds_in_the_installed_sglang():
    problems = check(listed(), instances=instances())
    assert not problems, "\n".join(problems)


# -- our code against the table ---------------------------------------------------------------------

def _our_files():
    for top in OUR_CODE:
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in NOT_SCANNED:
                yield rel, ast.parse(path.read_text())


def scan_our_code():
    """(private names used -> files, private names we define, SGLang modules we import or name)."""
    used, ours, modules = {}, set(), set()

    def use(name, rel):
        if name.startswith("_") and not name.startswith("__"):
            used.setdefault(name, set()).add(rel)

    for rel, tree in _our_files():
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute):
                use(n.attr, rel)
            elif isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] == "sglang":
                modules.add(n.module)
                for alias in n.names:
                    use(alias.name, rel)
            elif isinstance(n, ast.Import):
                modules.update(a.name for a in n.names if a.name.split(".")[0] == "sglang")
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and DOTTED.match(n.value):
                modules.add(n.value)
                for part in n.value.split(".")[1:]:
                    use(part, rel)
            elif isinstance(n, ast.keyword) and n.arg:  # replace(_name=...): a module attribute replaced
                use(n.arg, rel)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in (
                    "getattr", "setattr", "hasattr", "delattr") and len(n.args) > 1 \
                    and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str):
                use(n.args[1].value, rel)
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(n.name)
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for target in n.targets if isinstance(n, ast.Assign) else [n.target]:
                    for e in ast.walk(target):
                        if isinstance(e, ast.Name):
                            ours.add(e.id)
                        elif isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id in ("self", "cls"):
                            ours.add(e.attr)
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets):
                ours.update(e.value for e in ast.walk(n.value) if isinstance(e, ast.Constant) and isinstance(e.value, str))
    return used, ours, modules


def sglang_defines(files) -> set[str]:
    names = set()
    for path in files:
        names.update(DEFINES.findall(path.read_text(errors="replace")))
    return names


def module_files(modules) -> set[Path]:
    import sglang

    site = Path(sglang.__file__).parents[1]
    files = set()
    for dotted in modules:
        parts = dotted.split(".")
        for k in range(len(parts), 0, -1):
            base = site.joinpath(*parts[:k])
            if base.with_suffix(".py").is_file():
                files.add(base.with_suffix(".py"))
                break
            if (base / "__init__.py").is_file():
                files.add(base / "__init__.py")
                break
    return files


def test_every_private_sglang_name_our_code_uses_is_listed():
    """A private name our code uses and never defines, that SGLang's source defines (anywhere in
    `srt` or `kernels`), must be listed; so must one we also define ourselves where an SGLang
    module we import defines it too, unless it is known to be ours (OWN)."""
    import sglang

    used, ours, modules = scan_our_code()
    assert {"_node_arena", "_poll_timeout_aborts", "_cuda_host_register"} <= set(used)  # the scan sees them
    root = Path(sglang.__file__).parent
    everywhere = sglang_defines([p for sub in ("srt", "kernels") for p in (root / sub).rglob("*.py")])
    imported = sglang_defines(module_files(modules))
    known = listed_attrs()
    unlisted = sorted(f"{name} (in {', '.join(sorted(used[name]))})" for name in used
                      if name in everywhere and name not in ours and name not in known and name not in NOT_SGLANG)
    ambiguous = sorted(f"{name} (in {', '.join(sorted(used[name]))})" for name in used
                       if name in imported and name in ours and name not in known and name not in OWN)
    assert not unlisted, f"SGLang names our code uses, missing from third_party/README.md: {unlisted}"
    assert not ambiguous, f"names both we and SGLang define: list them in the README, or in OWN if ours: {ambiguous}"
    assert set(OWN) <= ours, "an OWN name we no longer define"


def our_sglang_subclasses():
    from sglang_marconi.serving.admission import admission_mixin
    from sglang_marconi.serving.cache import marconi_cache_class
    from sglang_marconi.serving.components import _component_classes
    from sglang_marconi.serving.swa_component import marconi_swa_component_class
    from sglang_marconi.serving.unified_memory import one_budget_cache_class

    full, mamba, _ = _component_classes()
    return [full, type("WithAdmission", (admission_mixin(), mamba), {}), marconi_cache_class(),
            one_budget_cache_class(), marconi_swa_component_class()]


def overrides():
    """(SGLang's dotted name, our function, SGLang's class) for every method our subclasses override."""
    out = []
    for cls in our_sglang_subclasses():
        base = next(k for k in cls.__mro__ if k.__module__.split(".")[0] == "sglang")
        for klass in cls.__mro__:
            if klass.__module__.split(".")[0] != "sglang_marconi":
                continue
            for name, value in klass.__dict__.items():
                if name.startswith("__") and name != "__init__":
                    continue
                if isinstance(value, (FunctionType, property, classmethod, staticmethod)) and hasattr(base, name):
                    out.append((f"{base.__module__}.{base.__qualname__}.{name}", value, base))
    return out


def test_every_method_we_override_is_listed_and_takes_every_call_sglang_makes():
    found = overrides()
    names = {dotted for dotted, _, _ in found}
    assert len(names) >= 40 and any(n.endswith("FullComponent._evict_device_start") for n in names)
    missing = sorted(names - listed_names())
    assert not missing, f"overrides missing from third_party/README.md: {missing}"
    problems = []
    for dotted, ours, base in found:
        if not isinstance(ours, FunctionType):
            problems.append(f"{dotted}: overridden by a {type(ours).__name__}")
            continue
        theirs = source_signature(base, dotted.rsplit(".", 1)[1])
        problems += [f"{dotted}: {p}" for p in accepts(inspect.signature(ours), theirs, leading=1)]
        problems += [f"{dotted}: our override reads kwargs[{k!r}]; no kwarg row {dotted}({k}=)"
                     for k in sorted(kwargs_keys_read(ours)) if f"{dotted}({k}=)" not in names]
    assert not problems, "\n".join(problems)


def registered_hooks(monkeypatch, times: int = 1):
    """Every (target, hook, hook type) our plugin registers when asked `times` times, recorded by a
    stand-in HookRegistry."""
    from sglang.srt.plugins import hook_registry

    from sglang_marconi.serving import hook_registration, kv_events, plugin, two_pass_prefill

    class Recording:
        _hooks, _patched, registered = {}, set(), []

        @classmethod
        def register(cls, target, hook, hook_type=hook_registry.HookType.AFTER, **kwargs):
            cls.registered.append((target, hook, hook_type))
            cls._hooks.setdefault(target, []).append((hook_type, hook, None))

        @classmethod
        def apply_hooks(cls):
            pass

    monkeypatch.setattr(hook_registry, "HookRegistry", Recording)
    monkeypatch.setattr(hook_registration, "_registered", set())
    monkeypatch.setattr(two_pass_prefill, "_originals", {})
    for _ in range(times):
        plugin.register()
        kv_events.install_hooks()  # registered where a Marconi cache class is built
    return Recording.registered


def test_asked_twice_the_plugin_registers_each_hook_once(monkeypatch):
    # (a hook registered twice runs twice: directives applied twice, figures added twice)
    once = registered_hooks(monkeypatch)
    twice = registered_hooks(monkeypatch, times=2)
    assert len(once) == 9 and twice == once


def test_every_hook_we_register_is_listed_takes_sglangs_calls_and_its_kwargs_keys_are_listed(monkeypatch):
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookType

    hooks = registered_hooks(monkeypatch)
    assert len({t for t, _, _ in hooks}) >= 9
    names, problems = listed_names(), []
    leading = {HookType.AROUND: 2, HookType.AFTER: 2, HookType.BEFORE: 1}  # (original | result), self
    for target, hook, hook_type in hooks:
        if target not in names:
            problems.append(f"{target}: hooked, missing from third_party/README.md")
            continue
        owner, attr = target.rsplit(".", 1)
        theirs = source_signature(pkgutil.resolve_name(owner), attr)
        problems += [f"{target} ({hook_type.name} {hook.__name__}): {p}"
                     for p in accepts(inspect.signature(hook), theirs, leading[hook_type])]
        for key in sorted(kwargs_keys_read(hook)):
            if f"{target}({key}=)" not in names:
                problems.append(f"{target}: our hook reads kwargs[{key!r}]; no kwarg row {target}({key}=)")
    assert not problems, "\n".join(problems)


def test_the_hooks_kwargs_keys_are_found():
    """The scan behind the kwarg rows sees what the two-pass hook reads."""
    from sglang_marconi.serving.two_pass_prefill import _HOOKS, SELECT_TARGET

    hook = dict(_HOOKS)[SELECT_TARGET]
    assert kwargs_keys_read(hook) == {"has_chunked_req", "truncation_align_size"}
    assert render(inspect.signature(inspect.unwrap(hook))) == "(original, adder, req, *args, **kwargs)"
