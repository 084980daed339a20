"""A digest of the installed `sglang_marconi` source: the ranks of one group agree on it at
start-up (`plugin.agree_on_settings`), so ranks running different code refuse to start together.

The package version alone cannot tell two commits apart. This hashes every `.py` file of the
package, in sorted relative-path order (never the file system's listing order, never mtimes),
each framed by its path and length, so a renamed, added, removed or edited file changes it.
Computed once per process: a few hundred kilobytes read once at start-up.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path


def tree_digest(root: Path) -> str:
    """Hex sha256 over every `.py` file under `root`: relative path, byte length, bytes."""
    root = Path(root)
    files = sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py") if p.is_file())
    h = hashlib.sha256()
    for rel, path in files:
        data = path.read_bytes()
        name = rel.encode("utf-8", "surrogateescape")
        h.update(len(name).to_bytes(8, "big") + name + len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


@functools.cache
def package_source_digest() -> str:
    """`tree_digest` of the installed `sglang_marconi` package (once per process)."""
    import sglang_marconi

    return tree_digest(Path(sglang_marconi.__file__).resolve().parent)
