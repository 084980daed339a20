"""The layering rules: the policy core imports neither torch nor SGLang nor anything above it."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "sglang_marconi"
# layer -> packages it must never import
# libcachesim is GPL-3.0-or-later: tests and benchmarks may use it, the Apache-2.0 package never
FORBIDDEN = {
    "policy": ("torch", "sglang", "sglang_marconi.sim", "sglang_marconi.serving", "libcachesim"),
    "sim": ("torch", "sglang", "sglang_marconi.serving", "libcachesim"),
    "serving": ("sglang_marconi.sim", "libcachesim"),  # SGLang only inside functions: checked below
    "plan": ("torch", "sglang", "sglang_marconi.serving", "libcachesim"),  # sits above sim: may import sim and policy, never an engine
}


def imports_of(path: Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def test_layers_do_not_import_upward_or_engines():
    bad = []
    for layer, forbidden in FORBIDDEN.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            for name in imports_of(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    bad.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not bad, bad


def test_importing_any_module_loads_no_torch_or_sglang():
    code = (
        "import sys, sglang_marconi.sim.cli, sglang_marconi.policy.tuning.shadow_tuner, sglang_marconi.policy.cost.model_profile,"
        " sglang_marconi.serving.plugin, sglang_marconi.serving.runtime, sglang_marconi.serving.cache,"
        " sglang_marconi.serving.admission, sglang_marconi.serving.metrics, sglang_marconi.serving.two_pass_prefill,"
        " sglang_marconi.serving.components, sglang_marconi.serving.tree_index, sglang_marconi.serving.eviction_settings,"
        " sglang_marconi.serving.group_channel, sglang_marconi.serving.lockstep, sglang_marconi.serving.background_tuner, sglang_marconi.launch_server;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sglang')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_no_module_imports_one_that_imports_it_back():
    """No import cycle among the package's modules (counting imports inside functions too)."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module = "sglang_marconi." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        graph[module] = {name for name in imports_of(path) if name.startswith("sglang_marconi.")}
    cycles = []

    def visit(node, stack, on_stack, done):
        on_stack.add(node)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack, on_stack, done)
        stack.pop()
        on_stack.discard(node)
        done.add(node)

    done = set()
    for module in sorted(graph):
        if module not in done:
            visit(module, [], set(), done)
    assert not cycles, cycles[:5]
