#!/usr/bin/env python3
"""Apply this project's patch set (`patches/*.patch`) to the installed SGLang, idempotently.

Each patch is a unified diff against the pinned SGLang, paths relative to the `sglang/` package
directory (`a/`/`b/` prefixes allowed), starting with a header comment block saying why the
plugin API cannot reach that behaviour. `third_party/sglang.lock` (JSON) pins the SGLang version,
its wheel (filename, sha256) and, for every file a patch touches, its sha256 before
(`pristine_sha256`) and after (`patched_sha256`) the whole patch set.

Nothing is backed up: a file whose hash is the pristine one is patched, a file whose hash is
the patched one is already done, anything else is refused (exit 2) before any file is written.
`--revert` applies the reverse diffs and checks the pristine hash. All files are computed in
memory and checked first; then each is replaced atomically.

    python scripts/apply_patches.py             # apply (no-op when already applied)
    python scripts/apply_patches.py --check     # exit 0 only if every patch is applied
    python scripts/apply_patches.py --dry-run   # say what would happen, write nothing
    python scripts/apply_patches.py --revert    # restore the pristine files
    python scripts/apply_patches.py --repin --wheel sglang-X-....whl   # rewrite the lock

Exit status: 0 done / all applied; 1 (--check) some patch not applied; 2 refused (version or
hash mismatch, a patch that does not apply, an inconsistent lock or patch set).
This script never imports SGLang (it locates it with importlib.util.find_spec).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOCK = ROOT / "third_party" / "sglang.lock"
DEFAULT_PATCHES = ROOT / "patches"
PACKAGE = "sglang"


class PatchError(Exception):
    """A refusal: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------------------------
# Unified diffs


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    lines: list[tuple[str, str]]  # (' ' | '-' | '+', text including its line ending, if any)

    def old(self) -> list[str]:
        return [t for op, t in self.lines if op in " -"]

    def new(self) -> list[str]:
        return [t for op, t in self.lines if op in " +"]

    def reversed(self) -> Hunk:
        swap = {" ": " ", "-": "+", "+": "-"}
        return Hunk(self.new_start, self.new_len, self.old_start, self.old_len,
                    [(swap[op], t) for op, t in self.lines])


@dataclass
class FilePatch:
    path: str  # relative to the sglang package directory
    hunks: list[Hunk] = field(default_factory=list)


@dataclass
class Patch:
    name: str
    header: str
    files: list[FilePatch]


_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def _strip_path(raw: str) -> str:
    path = raw.split("\t", 1)[0].strip()
    if path.startswith(("a/", "b/")):
        path = path[2:]
    if path.startswith(PACKAGE + "/"):
        path = path[len(PACKAGE) + 1:]
    return path


def parse_patch(text: str, name: str = "<patch>") -> Patch:
    """Parse a unified diff (the text before the first file header is the why-header)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    i, header, files = 0, [], []
    while i < len(lines) and not lines[i].startswith(("--- ", "diff ")):
        header.append(lines[i])
        i += 1
    while i < len(lines):
        line = lines[i]
        if not line.startswith("--- "):
            i += 1  # "diff --git", "index ...", blank lines between files
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"{name}: line {i + 1}: '---' not followed by '+++'")
        old_path, new_path = line[4:], lines[i + 1][4:]
        if old_path.split("\t")[0].strip() == "/dev/null" or new_path.split("\t")[0].strip() == "/dev/null":
            raise PatchError(f"{name}: line {i + 1}: patches may only modify existing files")
        target = FilePatch(_strip_path(new_path))
        if _strip_path(old_path) != target.path:
            raise PatchError(f"{name}: line {i + 1}: renames are not supported ({old_path} -> {new_path})")
        if target.path.startswith("/") or ".." in Path(target.path).parts:
            raise PatchError(f"{name}: line {i + 1}: path escapes the package: {target.path}")
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK_RE.match(lines[i])
            if not m:
                raise PatchError(f"{name}: line {i + 1}: bad hunk header {lines[i]!r}")
            old_start, new_start = int(m.group(1)), int(m.group(3))
            old_len = 1 if m.group(2) is None else int(m.group(2))
            new_len = 1 if m.group(4) is None else int(m.group(4))
            hunk, n_old, n_new = Hunk(old_start, old_len, new_start, new_len, []), 0, 0
            i += 1
            while n_old < old_len or n_new < new_len:
                if i >= len(lines):
                    raise PatchError(f"{name}: hunk at line {old_start} of {target.path} is truncated")
                body = lines[i]
                op, content = (body[0], body[1:]) if body else (" ", "")  # stripped blank context
                if op not in " -+":
                    raise PatchError(f"{name}: line {i + 1}: unexpected {body!r} inside a hunk")
                hunk.lines.append((op, content + "\n"))
                n_old += op in " -"
                n_new += op in " +"
                i += 1
                if i < len(lines) and lines[i].startswith("\\"):  # \ No newline at end of file
                    hunk.lines[-1] = (op, content)
                    i += 1
            if n_old != old_len or n_new != new_len:
                raise PatchError(f"{name}: hunk at line {old_start} of {target.path}: line counts disagree")
            target.hunks.append(hunk)
        if not target.hunks:
            raise PatchError(f"{name}: {target.path} has no hunks")
        files.append(target)
    if not files:
        raise PatchError(f"{name}: no file diffs found")
    return Patch(name, "\n".join(header).strip(), files)


def apply_hunks(text: str, hunks: list[Hunk], where: str = "") -> str:
    """Apply hunks (in order) to text; context must match exactly, at the stated line or,
    failing that, at the nearest offset after the previous hunk."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    pos = 0  # lines[:pos] are done (copied to out)
    offset = 0
    for number, hunk in enumerate(hunks, 1):
        old, new = hunk.old(), hunk.new()
        expected = (hunk.old_start - 1 if hunk.old_len else hunk.old_start) + offset
        at = _find(lines, old, expected, pos)
        if at is None:
            raise PatchError(f"hunk {number} (line {hunk.old_start}) does not apply{where}")
        out.extend(lines[pos:at])
        out.extend(new)
        pos = at + len(old)
        offset = at - (hunk.old_start - 1 if hunk.old_len else hunk.old_start)
    out.extend(lines[pos:])
    return "".join(out)


def _find(lines: list[str], block: list[str], expected: int, lower: int) -> int | None:
    n, size = len(block), len(lines)
    for delta in range(size + 1):
        for at in ((expected,) if delta == 0 else (expected - delta, expected + delta)):
            if lower <= at <= size - n and lines[at:at + n] == block:
                return at
        if expected - delta < lower and expected + delta > size - n:
            break
    return None


# ---------------------------------------------------------------------------------------------
# Patch set, lock, installed package


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_patches(patches_dir: Path) -> list[Patch]:
    patches = []
    for path in sorted(patches_dir.glob("*.patch")):
        patch = parse_patch(path.read_text(encoding="utf-8"), path.name)
        if not patch.header:
            raise PatchError(f"{path.name}: no header comment block saying why the plugin API cannot reach this")
        patches.append(patch)
    return patches


def hunks_by_file(patches: list[Patch]) -> dict[str, list[tuple[str, list[Hunk]]]]:
    """path -> [(patch name, hunks)] in patch order."""
    out: dict[str, list[tuple[str, list[Hunk]]]] = {}
    for patch in patches:
        for fp in patch.files:
            out.setdefault(fp.path, []).append((patch.name, fp.hunks))
    return out


def patch_text(text: str, per_file: list[tuple[str, list[Hunk]]], path: str, reverse: bool = False) -> str:
    steps = list(reversed(per_file)) if reverse else per_file
    for name, hunks in steps:
        if reverse:
            hunks = [h.reversed() for h in hunks]
        text = apply_hunks(text, hunks, f" to {path} ({name}{', reversed' if reverse else ''})")
    return text


def load_lock(path: Path) -> dict:
    try:
        lock = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PatchError(f"no lock file at {path}") from None
    except ValueError as exc:
        raise PatchError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(lock, dict) or "version" not in lock or not isinstance(lock.get("files", {}), dict):
        raise PatchError(f"{path}: expected {{'version': ..., 'wheel': {{...}}, 'files': {{...}}}}")
    lock.setdefault("files", {})
    return lock


def locate_sglang() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("SGLang is not installed in this Python (importlib.util.find_spec('sglang') is None)")
    return Path(list(spec.submodule_search_locations)[0])


def version_next_to(sglang_dir: Path) -> str:
    """The version of the sglang distribution installed beside this package directory."""
    for dist in importlib.metadata.distributions(path=[str(sglang_dir.parent)]):
        if (dist.metadata["Name"] or "").lower() == PACKAGE:
            return dist.version
    raise PatchError(f"no {PACKAGE}-*.dist-info next to {sglang_dir}; pass --sglang-version")


def read_version(args) -> str:
    if args.sglang_version:
        return args.sglang_version
    if args.sglang_dir:
        return version_next_to(Path(args.sglang_dir))
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise PatchError("SGLang is not installed (no distribution metadata for 'sglang')") from None


# ---------------------------------------------------------------------------------------------
# Plan: what each target file is and what it becomes


@dataclass
class FilePlan:
    path: str
    state: str  # "pristine" | "patched" | "mismatch" | "missing"
    actual: str | None
    pristine: str
    patched: str
    new_text: str | None = None  # what to write (apply: patched text; revert: pristine text)


def plan(sglang_dir: Path, lock: dict, patches: list[Patch], lock_path: Path) -> list[FilePlan]:
    by_file = hunks_by_file(patches)
    recorded = lock["files"]
    unrecorded = sorted(set(by_file) - set(recorded))
    if unrecorded:
        raise PatchError(f"{lock_path}: no recorded hashes for {', '.join(unrecorded)} (re-pin: --repin)")
    stale = sorted(set(recorded) - set(by_file))
    if stale:
        raise PatchError(f"{lock_path}: records {', '.join(stale)} but no patch touches it (re-pin: --repin)")
    plans = []
    for path in sorted(by_file):
        entry = recorded[path]
        pristine, patched = entry.get("pristine_sha256"), entry.get("patched_sha256")
        if not pristine or not patched:
            raise PatchError(f"{lock_path}: {path} needs pristine_sha256 and patched_sha256")
        file = sglang_dir / path
        if not file.is_file():
            plans.append(FilePlan(path, "missing", None, pristine, patched))
            continue
        actual = sha256(file.read_bytes())
        state = {pristine: "pristine", patched: "patched"}.get(actual, "mismatch")
        plans.append(FilePlan(path, state, actual, pristine, patched))
    return plans


def refuse_if_unexpected(plans: list[FilePlan], sglang_dir: Path) -> None:
    for p in plans:
        if p.state == "missing":
            raise PatchError(f"{sglang_dir / p.path} does not exist (not SGLang as pinned?)")
        if p.state == "mismatch":
            raise PatchError(
                f"refusing: {p.path} has sha256 {p.actual}, which is neither the pinned pristine "
                f"{p.pristine} nor the patched {p.patched} (edited by hand or a different SGLang build?)"
            )


def compute(plans: list[FilePlan], sglang_dir: Path, patches: list[Patch], revert: bool) -> None:
    """Fill new_text for every file that needs writing, checking the resulting hashes."""
    by_file = hunks_by_file(patches)
    for p in plans:
        if p.state == ("patched" if revert else "pristine"):
            text = (sglang_dir / p.path).read_bytes().decode("utf-8")
            new = patch_text(text, by_file[p.path], p.path, reverse=revert)
            want = p.pristine if revert else p.patched
            got = sha256(new.encode("utf-8"))
            if got != want:
                what = "reverting" if revert else "patching"
                raise PatchError(f"{what} {p.path} gives sha256 {got}, the lock expects {want} (re-pin: --repin)")
            p.new_text = new


def write_atomically(file: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
        os.chmod(tmp, file.stat().st_mode & 0o7777)
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    # Drop the byte-compiled copies so nothing can run the stale code.
    cache = file.parent / "__pycache__"
    if file.suffix == ".py" and cache.is_dir():
        for pyc in cache.glob(f"{file.stem}.*.pyc"):
            pyc.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Re-pinning from a wheel


def repin(wheel: Path, patches: list[Patch], lock_path: Path) -> dict:
    data = wheel.read_bytes()
    m = re.match(r"^([A-Za-z0-9_.]+)-([^-]+)-", wheel.name)
    if not m or m.group(1).lower().replace("_", "-") != PACKAGE:
        raise PatchError(f"{wheel.name} is not an {PACKAGE} wheel")
    files = {}
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        for path, per_file in sorted(hunks_by_file(patches).items()):
            member = f"{PACKAGE}/{path}"
            if member not in names:
                raise PatchError(f"{wheel.name} has no {member}")
            text = zf.read(member).decode("utf-8")
            patched = patch_text(text, per_file, path)
            files[path] = {"pristine_sha256": sha256(text.encode("utf-8")),
                           "patched_sha256": sha256(patched.encode("utf-8"))}
    lock = {"package": PACKAGE, "version": m.group(2),
            "wheel": {"filename": wheel.name, "sha256": sha256(data)}, "files": files}
    lock_path.write_text(json.dumps(lock, indent=2) + "\n", encoding="utf-8")
    return lock


# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="report; exit 0 only if every patch is applied")
    mode.add_argument("--revert", action="store_true", help="restore the pristine files (checked by hash)")
    mode.add_argument("--repin", action="store_true", help="rewrite the lock from --wheel and the patches")
    ap.add_argument("--dry-run", action="store_true", help="say what would be done, write nothing")
    ap.add_argument("--sglang-dir", help="the sglang package directory (default: the installed one)")
    ap.add_argument("--sglang-version", help="its version (default: its distribution metadata)")
    ap.add_argument("--patches-dir", default=str(DEFAULT_PATCHES), help="default: %(default)s")
    ap.add_argument("--lock", default=str(DEFAULT_LOCK), help="default: %(default)s")
    ap.add_argument("--wheel", help="with --repin: the downloaded pinned wheel")
    args = ap.parse_args(argv)
    try:
        return run(args)
    except PatchError as exc:
        print(f"apply_patches: {exc}", file=sys.stderr)
        return 2


def run(args) -> int:
    lock_path, patches_dir = Path(args.lock), Path(args.patches_dir)
    patches = load_patches(patches_dir)
    if args.repin:
        if not args.wheel:
            raise PatchError("--repin needs --wheel (pip download --no-deps sglang==X -d DIR)")
        lock = repin(Path(args.wheel), patches, lock_path)
        print(f"pinned {PACKAGE}=={lock['version']} ({lock['wheel']['filename']}, sha256 "
              f"{lock['wheel']['sha256']}), {len(lock['files'])} patched file(s) -> {lock_path}")
        return 0

    lock = load_lock(lock_path)
    version = read_version(args)
    if version != lock["version"]:
        raise PatchError(f"installed {PACKAGE} is {version} but the patches are pinned to {lock['version']} "
                         f"({lock_path}); install {PACKAGE}=={lock['version']} or re-pin")
    sglang_dir = Path(args.sglang_dir) if args.sglang_dir else locate_sglang()
    plans = plan(sglang_dir, lock, patches, lock_path)
    names = ", ".join(p.name for p in patches) or "none"

    if args.check:
        for p in plans:
            label = {"pristine": "not applied", "patched": "applied"}.get(p.state, p.state)
            detail = f" (sha256 {p.actual}; pristine {p.pristine}, patched {p.patched})" if p.state == "mismatch" else ""
            print(f"{label:12} {p.path}{detail}")
        if any(p.state in ("mismatch", "missing") for p in plans):
            return 2
        pending = [p for p in plans if p.state != "patched"]
        print(f"{PACKAGE} {version} at {sglang_dir}: patches {names}: "
              f"{'all applied' if not pending else f'{len(pending)} file(s) not patched'}")
        if args.dry_run and pending:  # would they apply?
            compute(plans, sglang_dir, patches, revert=False)
            print(f"dry run: the patch set applies cleanly to {len(pending)} file(s)")
        return 1 if pending else 0

    refuse_if_unexpected(plans, sglang_dir)
    compute(plans, sglang_dir, patches, revert=args.revert)
    todo = [p for p in plans if p.new_text is not None]
    verb = "revert" if args.revert else "patch"
    for p in plans:
        if p.new_text is None:
            print(f"{'already pristine' if args.revert else 'already applied':16} {p.path}")
        else:
            print(f"{('would ' + verb) if args.dry_run else verb + 'ed':16} {p.path}")
            if not args.dry_run:
                write_atomically(sglang_dir / p.path, p.new_text)
    print(f"{PACKAGE} {version} at {sglang_dir}: patches {names}: "
          f"{len(todo)} file(s) {'to ' + verb if args.dry_run else verb + 'ed'}, "
          f"{len(plans) - len(todo)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
