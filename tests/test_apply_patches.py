"""scripts/apply_patches.py: the unified-diff applier, and apply / re-apply / --check / --revert /
--dry-run / --repin against a fake `sglang` package tree; plus the shipped patch set against a
copy of the installed SGLang's files (skipped without SGLang)."""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "apply_patches.py"
_spec = importlib.util.spec_from_file_location("apply_patches", SCRIPT)
ap = importlib.util.module_from_spec(_spec)
sys.modules["apply_patches"] = ap
_spec.loader.exec_module(ap)

HEADER = "# Why: the plugin API cannot reach the middle of `f`.\n# (test patch)\n"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def udiff(path: str, old: str, new: str, context: int = 3) -> str:
    lines = difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                 f"a/{path}", f"b/{path}", n=context)
    out = []
    for line in lines:
        out.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(out)


MOD_OLD = "".join(f"line {i}\n" for i in range(1, 41))
MOD_NEW = MOD_OLD.replace("line 5\n", "line 5 patched\n").replace("line 30\n", "line 30\nline 30b\n")
UTIL_OLD = "def f():\n    return 1\n"
UTIL_NEW = "def f():\n    return 2\n"


class Tree:
    """tmp/site/sglang (+ sglang-<version>.dist-info), tmp/patches, tmp/sglang.lock."""

    def __init__(self, tmp: Path, version: str = "0.5.23"):
        self.site, self.patches, self.lock = tmp / "site", tmp / "patches", tmp / "sglang.lock"
        self.pkg = self.site / "sglang"
        (self.pkg / "srt" / "managers").mkdir(parents=True)
        self.patches.mkdir()
        self.write("srt/managers/mod.py", MOD_OLD)
        self.write("srt/util.py", UTIL_OLD)
        self.write("untouched.py", "x = 1\n")
        self.set_version(version)
        (self.patches / "0001-mod.patch").write_text(HEADER + udiff("srt/managers/mod.py", MOD_OLD, MOD_NEW))
        (self.patches / "0002-util.patch").write_text(HEADER + udiff("srt/util.py", UTIL_OLD, UTIL_NEW))
        self.write_lock()

    def set_version(self, version: str):
        for old in self.site.glob("sglang-*.dist-info"):
            shutil.rmtree(old)
        info = self.site / f"sglang-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")

    def write(self, rel: str, text: str):
        (self.pkg / rel).write_text(text)

    def read(self, rel: str) -> str:
        return (self.pkg / rel).read_text()

    def write_lock(self, **overrides):
        lock = {"package": "sglang", "version": "0.5.23",
                "wheel": {"filename": "sglang-0.5.23-py3-none-any.whl", "sha256": "0" * 64},
                "files": {"srt/managers/mod.py": {"pristine_sha256": sha(MOD_OLD), "patched_sha256": sha(MOD_NEW)},
                          "srt/util.py": {"pristine_sha256": sha(UTIL_OLD), "patched_sha256": sha(UTIL_NEW)}}}
        lock.update(overrides)
        self.lock.write_text(json.dumps(lock))

    def run(self, *args, capsys=None):
        code = ap.main(["--sglang-dir", str(self.pkg), "--patches-dir", str(self.patches),
                        "--lock", str(self.lock), *args])
        out = capsys.readouterr() if capsys else None
        return code, out


@pytest.fixture
def tree(tmp_path):
    return Tree(tmp_path)


# --- the applier -------------------------------------------------------------------------------


def test_parse_reads_header_and_hunks():
    patch = ap.parse_patch(HEADER + udiff("srt/managers/mod.py", MOD_OLD, MOD_NEW), "p")
    assert patch.header.startswith("# Why:")
    (fp,) = patch.files
    assert fp.path == "srt/managers/mod.py" and len(fp.hunks) == 2


def test_git_style_diff_and_sglang_prefixed_paths():
    text = ("why\n\ndiff --git a/sglang/srt/util.py b/sglang/srt/util.py\nindex 123..456 100644\n"
            + udiff("sglang/srt/util.py", UTIL_OLD, UTIL_NEW))
    patch = ap.parse_patch(text, "p")
    assert patch.files[0].path == "srt/util.py"
    assert ap.apply_hunks(UTIL_OLD, patch.files[0].hunks) == UTIL_NEW


def test_hunks_apply_at_an_offset():
    hunks = ap.parse_patch(udiff("m.py", MOD_OLD, MOD_NEW), "p").files[0].hunks
    shifted = "extra 1\nextra 2\n" + MOD_OLD
    assert ap.apply_hunks(shifted, hunks) == "extra 1\nextra 2\n" + MOD_NEW


def test_hunk_that_does_not_match_is_refused():
    hunks = ap.parse_patch(udiff("m.py", MOD_OLD, MOD_NEW), "p").files[0].hunks
    with pytest.raises(ap.PatchError, match="hunk 1 .* does not apply"):
        ap.apply_hunks(MOD_OLD.replace("line 4\n", "line four\n"), hunks)


def test_no_newline_at_end_of_file_both_ways():
    old, new = "a\nb\nc", "a\nB\nc\nd"
    hunks = ap.parse_patch(udiff("m.py", old, new), "p").files[0].hunks
    assert ap.apply_hunks(old, hunks) == new
    assert ap.apply_hunks(new, [h.reversed() for h in hunks]) == old


def test_blank_context_lines_with_stripped_trailing_space():
    old, new = "a\n\nb\nc\n", "a\n\nb\nC\n"
    diff = udiff("m.py", old, new).replace("\n \n", "\n\n")  # an editor stripped the lone space
    assert ap.apply_hunks(old, ap.parse_patch(diff, "p").files[0].hunks) == new


def test_new_files_and_malformed_patches_are_refused():
    with pytest.raises(ap.PatchError, match="only modify existing files"):
        ap.parse_patch("--- /dev/null\n+++ b/x.py\n@@ -0,0 +1 @@\n+x\n", "p")
    with pytest.raises(ap.PatchError, match="truncated"):
        ap.parse_patch("--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,2 @@\n-a\n+b\n", "p")
    with pytest.raises(ap.PatchError, match="escapes"):
        ap.parse_patch("--- a/../x.py\n+++ b/../x.py\n@@ -1 +1 @@\n-a\n+b\n", "p")


lines_st = st.lists(st.sampled_from(["a", "b", "c", "def f():", "    return 1", ""]), max_size=40)


@settings(max_examples=200, deadline=None)
@given(old=lines_st, new=lines_st, context=st.integers(0, 4), eol=st.booleans())
def test_difflib_diffs_apply_and_reverse(old, new, context, eol):
    end = "\n" if eol else ""
    old_text = "\n".join(old) + (end if old else "")
    new_text = "\n".join(new) + (end if new else "")
    diff = udiff("m.py", old_text, new_text, context)
    if not diff:
        return
    hunks = ap.parse_patch(diff, "p").files[0].hunks
    assert ap.apply_hunks(old_text, hunks) == new_text
    assert ap.apply_hunks(new_text, [h.reversed() for h in hunks]) == old_text


# --- the command on a fake package tree -------------------------------------------------------


def test_apply_then_reapply_is_idempotent(tree, capsys):
    code, out = tree.run(capsys=capsys)
    assert code == 0 and "patched" in out.out
    assert tree.read("srt/managers/mod.py") == MOD_NEW and tree.read("srt/util.py") == UTIL_NEW
    assert tree.read("untouched.py") == "x = 1\n"
    stamp = os.stat(tree.pkg / "srt/util.py").st_mtime_ns
    code, out = tree.run(capsys=capsys)
    assert code == 0 and out.out.count("already applied") == 2
    assert os.stat(tree.pkg / "srt/util.py").st_mtime_ns == stamp


def test_check_reports_applied_not_applied_and_mismatch(tree, capsys):
    code, out = tree.run("--check", capsys=capsys)
    assert code == 1 and out.out.count("not applied") == 2
    tree.run()
    code, out = tree.run("--check", capsys=capsys)
    assert code == 0 and out.out.count("applied ") == 2 and "all applied" in out.out
    tree.write("srt/util.py", "edited\n")
    code, out = tree.run("--check", capsys=capsys)
    assert code == 2 and "mismatch" in out.out and sha("edited\n") in out.out


def test_check_dry_run_proves_the_patches_apply(tree, capsys):
    code, out = tree.run("--check", "--dry-run", capsys=capsys)
    assert code == 1 and "applies cleanly to 2 file(s)" in out.out
    assert tree.read("srt/util.py") == UTIL_OLD


def test_dry_run_writes_nothing(tree, capsys):
    code, out = tree.run("--dry-run", capsys=capsys)
    assert code == 0 and out.out.count("would patch") == 2
    assert tree.read("srt/managers/mod.py") == MOD_OLD and tree.read("srt/util.py") == UTIL_OLD


def test_revert_restores_pristine_and_is_idempotent(tree, capsys):
    tree.run()
    code, out = tree.run("--revert", "--dry-run", capsys=capsys)
    assert code == 0 and tree.read("srt/util.py") == UTIL_NEW
    code, out = tree.run("--revert", capsys=capsys)
    assert code == 0 and out.out.count("reverted ") == 2 and "2 file(s) reverted" in out.out
    assert tree.read("srt/managers/mod.py") == MOD_OLD and tree.read("srt/util.py") == UTIL_OLD
    code, out = tree.run("--revert", capsys=capsys)
    assert code == 0 and out.out.count("already pristine") == 2


def test_half_applied_tree_is_completed(tree, capsys):
    tree.write("srt/util.py", UTIL_NEW)  # one file already patched, the other not
    code, out = tree.run(capsys=capsys)
    assert code == 0 and "already applied" in out.out
    assert tree.read("srt/managers/mod.py") == MOD_NEW


def test_version_mismatch_is_refused(tree, capsys):
    tree.set_version("0.5.22")
    code, out = tree.run(capsys=capsys)
    assert code == 2 and tree.read("srt/util.py") == UTIL_OLD
    (line,) = out.err.strip().splitlines()
    assert "0.5.22" in line and "0.5.23" in line
    code, out = tree.run("--sglang-version", "0.5.23", capsys=capsys)  # explicit override
    assert code == 0


def test_hash_mismatch_is_refused_before_writing_anything(tree, capsys):
    edited = UTIL_OLD + "# local edit\n"
    tree.write("srt/util.py", edited)
    code, out = tree.run(capsys=capsys)
    assert code == 2
    (line,) = out.err.strip().splitlines()
    assert "srt/util.py" in line and sha(edited) in line
    assert sha(UTIL_OLD) in line and sha(UTIL_NEW) in line
    assert tree.read("srt/managers/mod.py") == MOD_OLD  # the other, pristine file was not touched
    code, out = tree.run("--revert", capsys=capsys)
    assert code == 2 and tree.read("srt/util.py") == edited


def test_patch_edited_without_repinning_is_refused(tree, capsys):
    (tree.patches / "0002-util.patch").write_text(HEADER + udiff("srt/util.py", UTIL_OLD, "def f():\n    return 3\n"))
    code, out = tree.run(capsys=capsys)
    assert code == 2 and "re-pin" in out.err and tree.read("srt/util.py") == UTIL_OLD


def test_inconsistent_lock_or_patch_set_is_refused(tree, capsys):
    tree.write_lock(files={"srt/util.py": {"pristine_sha256": sha(UTIL_OLD), "patched_sha256": sha(UTIL_NEW)}})
    code, out = tree.run(capsys=capsys)
    assert code == 2 and "no recorded hashes for srt/managers/mod.py" in out.err
    tree.write_lock()
    (tree.patches / "0003-noheader.patch").write_text(udiff("srt/util.py", UTIL_NEW, UTIL_NEW + "y = 2\n"))
    code, out = tree.run(capsys=capsys)
    assert code == 2 and "0003-noheader.patch" in out.err and "why" in out.err


def test_stale_bytecode_is_removed(tree):
    cache = tree.pkg / "srt" / "__pycache__"
    cache.mkdir()
    (cache / "util.cpython-311.pyc").write_bytes(b"stale")
    (cache / "other.cpython-311.pyc").write_bytes(b"keep")
    tree.run()
    assert sorted(p.name for p in cache.iterdir()) == ["other.cpython-311.pyc"]


def test_repin_from_a_wheel(tree, tmp_path, capsys):
    wheel = tmp_path / "sglang-0.5.24-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("sglang/srt/managers/mod.py", MOD_OLD)
        zf.writestr("sglang/srt/util.py", UTIL_OLD)
    code, out = tree.run("--repin", "--wheel", str(wheel), capsys=capsys)
    assert code == 0
    lock = json.loads(tree.lock.read_text())
    assert lock["version"] == "0.5.24" and lock["wheel"] == {
        "filename": wheel.name, "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest()}
    assert lock["files"]["srt/util.py"] == {"pristine_sha256": sha(UTIL_OLD), "patched_sha256": sha(UTIL_NEW)}
    tree.set_version("0.5.24")
    assert tree.run()[0] == 0 and tree.read("srt/util.py") == UTIL_NEW


def test_command_line_runs_without_importing_sglang(tree):
    code = (
        "import runpy, sys\n"
        f"sys.argv = ['apply_patches.py', '--check', '--sglang-dir', {str(tree.pkg)!r},"
        f" '--patches-dir', {str(tree.patches)!r}, '--lock', {str(tree.lock)!r}]\n"
        f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
        "except SystemExit as e:\n    print('exit', e.code, 'sglang' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "exit 1 False", out.stdout + out.stderr


# --- the shipped patch set against the installed SGLang ----------------------------------------


def _installed_sglang():
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("SGLang is not installed")
    from importlib.metadata import version

    return Path(list(spec.submodule_search_locations)[0]), version("sglang")


def test_shipped_patches_apply_cleanly_to_the_pinned_sglang(tmp_path, capsys):
    sglang_dir, installed = _installed_sglang()
    lock = json.loads((ROOT / "third_party" / "sglang.lock").read_text())
    assert installed == lock["version"], "the installed SGLang is not the pinned one"
    assert re.fullmatch(r"[0-9a-f]{64}", lock["wheel"]["sha256"]) and lock["wheel"]["filename"].startswith(
        f"sglang-{lock['version']}-")
    patches = ap.load_patches(ROOT / "patches")
    targets = sorted(ap.hunks_by_file(patches))
    assert targets == sorted(lock["files"])
    copy = tmp_path / "sglang"
    for rel in targets:  # a copy of only the target files, pristine in the installed tree
        src = sglang_dir / rel
        assert ap.sha256(src.read_bytes()) in (lock["files"][rel]["pristine_sha256"],
                                                lock["files"][rel]["patched_sha256"])
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, copy / rel)
    copy.mkdir(exist_ok=True)
    args = ["--sglang-dir", str(copy), "--sglang-version", installed]
    assert ap.main(args + ["--revert"]) == 0  # whatever state the installed copy is in
    assert ap.main(args + ["--dry-run"]) == 0
    assert ap.main(args) == 0
    assert ap.main(args + ["--check"]) == 0
    assert ap.main(args + ["--revert"]) == 0
    for rel in targets:
        assert ap.sha256((copy / rel).read_bytes()) == lock["files"][rel]["pristine_sha256"]
    capsys.readouterr()


def test_applier_on_a_real_sglang_source_file(tmp_path):
    """The applier on SGLang's real scheduler policy (1,700+ lines): a diff made by difflib from an
    edit in the middle of PrefillAdder applies, re-applies as a no-op and reverts to the byte."""
    sglang_dir, installed = _installed_sglang()
    rel = "srt/managers/schedule_policy.py"
    old = (sglang_dir / rel).read_text()
    anchor = "    def add_chunked_req(self, req: Req):\n"
    assert anchor in old
    new = old.replace(anchor, anchor + "        # patched by the test\n", 1).replace(
        "CLIP_MAX_NEW_TOKENS = int(", "CLIP_MAX_NEW_TOKENS = int(  # also patched\n", 1)
    t = Tree(tmp_path)
    for p in t.patches.iterdir():
        p.unlink()
    (t.patches / "0001-real.patch").write_text(HEADER + udiff(rel, old, new))
    (t.pkg / rel).write_text(old)
    files = {"srt/managers/schedule_policy.py": {"pristine_sha256": sha(old), "patched_sha256": sha(new)}}
    t.write_lock(files=files)
    assert t.run()[0] == 0 and t.read(rel) == new
    assert t.run()[0] == 0 and t.run("--check")[0] == 0
    assert t.run("--revert")[0] == 0 and (t.pkg / rel).read_bytes() == old.encode()

