"""`python -m sglang_marconi.launch_server`: SGLang's launcher with the Marconi cache.

Every SGLang flag works as in SGLang's own launcher. Marconi's own flags (`--marconi-*`, see
`--help`) are taken out, checked, and handed to the scheduler processes; for hybrid models the
`marconi` radix-cache backend is selected unless `--radix-cache-backend` says otherwise.

SGLang's other flags are forwarded untouched. Those with which Marconi cannot act
(`--enable-hierarchical-cache`, `--enable-session-radix-cache`, `--enable-lmcache`,
`--enable-flexkv`, a `--radix-eviction-policy` other than `lru`) reach SGLang as given and the
backend's factory builds upstream's cache for them, with one warning (`serving/plugin.py`), the
same as through `python -m sglang.launch_server --radix-cache-backend marconi`. SGLang refuses any
`--radix-cache-backend` with a few flags (`NO_BACKEND_FLAGS`): with one of them the launcher does
not select `marconi` (one warning line), and refuses in one line if `marconi` was asked for.
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang_marconi.policy.errors import MarconiError
from sglang_marconi.serving.config import ENV_VAR, add_marconi_args, config_from_args


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def gpu_problem(device: str | None) -> str | None:
    """One line saying why SGLang cannot start on this machine's accelerator, or None."""
    if device not in (None, "cuda"):
        return None
    try:
        import torch
    except ImportError:
        return "SGLang is not installed here: pip install 'sglang-marconi[serve]'"
    if not torch.cuda.is_available():
        return ("no CUDA GPU is visible (torch.cuda.is_available() is False); SGLang serves on a GPU "
                "(or pass --device for another backend)")
    return None


# SGLang flags with which SGLang itself refuses any --radix-cache-backend (sglang/srt/arg_groups/:
# hicache_hook.py handle_hicache, mamba_hook.py handle_int8_mamba_checkpoint, kv_shard_hook.py
# handle_kv_cache_sharding).
NO_BACKEND_FLAGS = (
    "--enable-unified-cache-external-linker",
    "--enable-int8-mamba-checkpoint",
    "--enable-kv-cache-sharding",
)


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def prepare(argv: list[str]) -> list[str]:
    """Strip and validate Marconi's flags, export them, and return SGLang's argv."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_marconi_args(parser)
    ns, rest = parser.parse_known_args(argv)
    os.environ[ENV_VAR] = config_from_args(ns).to_env()
    backend = _flag_value(rest, "--radix-cache-backend")
    blocker = next((flag for flag in NO_BACKEND_FLAGS if _has_flag(rest, flag)), None)
    if blocker is not None:
        if backend == "marconi":
            raise MarconiError(f"{blocker}: SGLang accepts no --radix-cache-backend with it; "
                               "drop --radix-cache-backend marconi (Marconi cannot run with this flag)")
        if backend is None:
            print(f"warning: {blocker}: SGLang accepts no --radix-cache-backend with it; serving with "
                  "upstream's cache, without Marconi", file=sys.stderr)
        return rest
    if backend is None:
        rest = [*rest, "--radix-cache-backend", "marconi"]
    return rest


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        helper = argparse.ArgumentParser(prog="python -m sglang_marconi.launch_server", add_help=False,
                                         description="SGLang's launcher plus these Marconi flags:")
        add_marconi_args(helper)
        helper.print_help()
        print("\nSGLang's own flags follow.\n")
    try:
        sglang_argv = prepare(argv)
    except MarconiError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = None if "--help" in argv or "-h" in argv else gpu_problem(_flag_value(sglang_argv, "--device"))
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    from sglang_marconi.serving.plugin import register

    load_plugins()
    register()  # also when this package runs from a checkout without its entry point installed
    server_args = prepare_server_args(sglang_argv)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
