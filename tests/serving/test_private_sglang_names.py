"""Every private SGLang name we touch (third_party/README.md, "Private SGLang names we touch")
still exists in the installed SGLang: the checklist for the next version bump, checked."""

import pkgutil
import re
from pathlib import Path

import pytest

pytest.importorskip("sglang")

README = Path(__file__).resolve().parents[2] / "third_party" / "README.md"
ROW = re.compile(r"^\| `(sglang\.[A-Za-z0-9_.]+)` \| ([a-z ]+) \|")


def listed():
    rows = [ROW.match(line) for line in README.read_text().splitlines()]
    return [(m.group(1), m.group(2).strip()) for m in rows if m]


def instances():
    """SGLang objects built on CPU, by class name: where attributes set in `__init__` live."""
    from sglang_cpu import build_cache
    from sglang.srt.server_args import ServerArgs

    cc = build_cache()
    return {"UnifiedTreeCore": cc.cache.tree_core, "UnifiedRadixCache": cc.cache,
            "ServerArgs": ServerArgs(model_path="dummy")}


def sglang_source() -> str:
    import sglang

    root = Path(sglang.__file__).parent / "srt"
    return "\n".join(p.read_text(errors="replace") for p in root.rglob("*.py"))


def test_the_list_is_there_and_names_every_kind():
    names = listed()
    assert len(names) >= 20
    assert {kind for _, kind in names} >= {"method", "instance", "class", "class attribute", "walk state"}


def test_every_listed_private_name_exists_in_the_installed_sglang():
    built = instances()
    missing = []
    for dotted, kind in listed():
        owner_path, attr = dotted.rsplit(".", 1)
        try:
            owner = pkgutil.resolve_name(owner_path)
        except (ImportError, AttributeError):
            missing.append(f"{owner_path} (for {attr})")
            continue
        if kind == "instance":
            target = built[owner.__name__]
            if not hasattr(target, attr) and attr not in getattr(target, "__dict__", {}):
                missing.append(dotted)
        elif kind in ("walk state", "memo"):  # set by SGLang after __init__: it must still assign it
            if not re.search(rf"\.{attr}\s*=", sglang_source()):
                missing.append(dotted)
        elif not hasattr(owner, attr):
            missing.append(dotted)
    assert not missing, missing


def test_the_check_can_fail():
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    assert not hasattr(UnifiedTreeCore, "_no_such_private_name")
