"""Our hooks on SGLang's `HookRegistry`, registered once per process.

The registry runs a hook as many times as it was registered, and `plugin.register()` (or a cache
class built twice) may ask again: `register_once` registers a caller's hooks the first time that
caller asks and does nothing after. SGLang is imported only when a caller registers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_registered: set[str] = set()  # the callers whose hooks are registered


def register_once(caller: str, hooks: Iterable[tuple[str, Callable, str]], *, apply: bool = False) -> None:
    """Register each (target, hook, "before" | "after" | "around") for `caller` unless done before;
    `apply=True` also applies the registry's hooks at once (SGLang patches only targets not yet
    patched)."""
    if caller in _registered:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, HookType(kind))
    if apply:
        HookRegistry.apply_hooks()
    _registered.add(caller)
