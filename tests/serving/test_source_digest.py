"""The start-up digest the ranks of a group agree on covers the installed `sglang_marconi` source:
one byte of difference anywhere changes it; the file system's listing order and mtimes do not."""

import os
import random
from pathlib import Path

import pytest

from sglang_marconi.serving import source_digest
from sglang_marconi.serving.source_digest import package_source_digest, tree_digest

FILES = {
    "__init__.py": "__version__ = '0.1.0'\n",
    "policy/__init__.py": "",
    "policy/rules/eviction.py": "def victim(nodes):\n    return min(nodes)\n",
    "serving/runtime.py": "SYNC_EVERY = 64\n" * 50,
    "serving/z_last.py": "X = 1\n",
}


def write_tree(root: Path, files=FILES, order=None, mtime=None) -> Path:
    for rel in order or list(files):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(files[rel])
        if mtime is not None:
            os.utime(path, (mtime, mtime))
    return root


def test_the_same_tree_gives_the_same_digest_whatever_the_order_and_mtimes(tmp_path, monkeypatch):
    a = write_tree(tmp_path / "a", mtime=1_000_000)
    b = write_tree(tmp_path / "b", order=list(reversed(FILES)), mtime=2_000_000_000)
    (b / "serving" / "__pycache__").mkdir()
    (b / "serving" / "__pycache__" / "runtime.cpython-311.pyc").write_bytes(b"\x00compiled")
    (b / "README.md").write_text("not source")
    assert tree_digest(a) == tree_digest(b)

    base = tree_digest(a)
    listing, seeds = Path.rglob, iter(range(1, 100))

    def reversed_listing(self, pattern):
        return iter(reversed(list(listing(self, pattern))))

    def shuffled_listing(self, pattern):
        found = list(listing(self, pattern))
        random.Random(next(seeds)).shuffle(found)
        return iter(found)

    for other_order in (reversed_listing, shuffled_listing):  # the file system lists in any order
        monkeypatch.setattr(Path, "rglob", other_order)
        assert tree_digest(a) == base and tree_digest(b) == base


@pytest.mark.parametrize("rel", list(FILES))
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_one_byte_anywhere_changes_the_digest(tmp_path, rel, where):
    base = tree_digest(write_tree(tmp_path / "base"))
    text = FILES[rel] or " "
    i = {"first": 0, "middle": len(text) // 2, "last": len(text) - 1}[where]
    changed = dict(FILES, **{rel: text[:i] + chr(ord(text[i]) ^ 1) + text[i + 1:]})
    if not FILES[rel]:
        changed[rel] = " "  # an empty file gains its one byte
    assert tree_digest(write_tree(tmp_path / "changed", changed)) != base


def test_a_renamed_file_or_a_byte_moved_across_files_changes_the_digest(tmp_path):
    base = tree_digest(write_tree(tmp_path / "base"))
    renamed = {("serving/y_last.py" if k == "serving/z_last.py" else k): v for k, v in FILES.items()}
    assert tree_digest(write_tree(tmp_path / "renamed", renamed)) != base
    # the same bytes in the same order, the boundary between two files moved by one byte
    moved = dict(FILES, **{"policy/rules/eviction.py": FILES["policy/rules/eviction.py"][:-1],
                           "serving/runtime.py": "\n" + FILES["serving/runtime.py"]})
    assert tree_digest(write_tree(tmp_path / "moved", moved)) != base
    extra = dict(FILES, **{"serving/new.py": ""})
    assert tree_digest(write_tree(tmp_path / "extra", extra)) != base


def test_the_package_digest_is_computed_once_per_process(monkeypatch):
    package_source_digest.cache_clear()
    calls = []
    real = source_digest.tree_digest
    monkeypatch.setattr(source_digest, "tree_digest", lambda root: calls.append(root) or real(root))
    first = package_source_digest()
    assert package_source_digest() == first and len(calls) == 1
    import sglang_marconi

    assert calls[0] == Path(sglang_marconi.__file__).resolve().parent
    assert len(first) == 64
    package_source_digest.cache_clear()


class RecordingGroup:
    def __init__(self):
        self.agreed = []

    def agree_on_settings(self, digest, what="Marconi settings", remedy=None):
        self.agreed.append((what, digest))


def agreed(monkeypatch, source, config):
    from types import SimpleNamespace

    from sglang_marconi.serving import plugin
    from sglang_marconi.serving.config import ENV_VAR

    monkeypatch.setattr(source_digest, "package_source_digest", lambda: source)
    monkeypatch.setenv(ENV_VAR, config)
    group = RecordingGroup()
    plugin.agree_on_settings(group, SimpleNamespace(params=SimpleNamespace(page_size=1)))
    return group.agreed


def test_ranks_agree_on_the_source_as_well_as_the_settings(monkeypatch):
    """What each rank passes to the group's start-up agreement: a rank with other source files
    (same version string, same settings) passes another digest, and the error names the source."""
    same = agreed(monkeypatch, "a" * 64, '{"alpha": 1}')
    assert agreed(monkeypatch, "a" * 64, '{"alpha": 1}') == same
    other_source = agreed(monkeypatch, "b" * 64, '{"alpha": 1}')
    other_settings = agreed(monkeypatch, "a" * 64, '{"alpha": 2}')
    assert [d for _, d in other_source] != [d for _, d in same]
    assert [d for _, d in other_settings] != [d for _, d in same]
    (source_what, _), (settings_what, _) = same
    assert "sglang_marconi source" in source_what and settings_what == "Marconi settings"
    assert other_source[0] != same[0] and other_source[1] == same[1]  # the error names the one that differs
    assert other_settings[0] == same[0] and other_settings[1] != same[1]


def _gloo_rank(rank, init_file, scenarios, queue):
    """One rank of a two-rank gloo group: the plugin's start-up agreement once per scenario, with
    this rank's source digest of that scenario (as if its files differed), the same settings."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from sglang_marconi.serving import plugin, source_digest
    from sglang_marconi.serving.lockstep import RankGroup

    outcomes = []
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        group = RankGroup([dist.group.WORLD])
        for sources in scenarios:
            source_digest.package_source_digest = lambda: sources[rank]
            try:
                plugin.agree_on_settings(group, SimpleNamespace(params=SimpleNamespace(page_size=1)))
                outcomes.append(None)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                outcomes.append(f"{type(exc).__name__}: {exc}")
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        outcomes.append(f"crashed: {type(exc).__name__}: {exc}")
    finally:
        queue.put((rank, outcomes))
        if dist.is_initialized():
            dist.destroy_process_group()


def _two_gloo_ranks(tmp_path, scenarios):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, str(tmp_path / "gloo-init"), scenarios, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return dict(queue.get(timeout=300) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def test_two_ranks_with_different_source_refuse_to_start_naming_it(tmp_path):
    """Two real ranks: the same source agrees; one differing character refuses on both, in one line."""
    pytest.importorskip("torch")
    outcomes = _two_gloo_ranks(tmp_path, [("a" * 64, "a" * 64), ("a" * 64, "a" * 63 + "b")])
    for rank in (0, 1):
        same, differ = outcomes[rank]
        assert same is None, outcomes
        assert differ.startswith("MarconiError: ") and "sglang_marconi source" in differ, outcomes
        assert "install the same sglang_marconi files" in differ and "SGLANG_MARCONI_CONFIG" not in differ
        assert "\n" not in differ
