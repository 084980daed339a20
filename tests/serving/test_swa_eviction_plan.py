"""Marconi's victim order under SWA-pool pressure (`serving/swa_component.plan_victims`, the
reference of `policy/rules/window_plan.py`), on small trees of stand-in nodes shaped like SGLang's
(`key`, `children`, `parent`, per-component data): stale windows first, never a tombstone inside
a branch's last window (SGLang #35515), branch-point windows and leaves ranked by recency + alpha
x FLOPs saved per byte, locked data never touched. The incremental `WindowPlan` on the same
nodes, told of changes by hand as an engine would, equals the reference."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest

from sglang_marconi.serving.swa_component import SWAFigures, SWASettings, plan_victims, profile_for_swa

SWA, FULL = "swa", "full"
WINDOW = 8
_ids = itertools.count(1)
TINY_MELLUM = dict(
    architectures=["MellumForCausalLM"], model_type="mellum", vocab_size=512, hidden_size=64,
    intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    layer_types=["sliding_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] * 4,
    sliding_window=WINDOW, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, torch_dtype="bfloat16")


def node(parent, length, *, t, swa=True, locked=False):
    n = SimpleNamespace(id=next(_ids), key=[0] * length, children={}, parent=parent, last_access_time=t,
                        component_data={SWA: SimpleNamespace(value=[0] * length if swa else None,
                                                             lock_ref=int(locked))})
    if parent is not None:
        parent.children[n.id] = n
    return n


def settings(alpha=1.0):
    return SWASettings(profile=profile_for_swa(TINY_MELLUM), alpha=alpha, window=WINDOW, figures=SWAFigures())


def plan(root, alpha=1.0, evictable=None):
    leaves = evictable if evictable is not None else _leaves(root)
    tree = SimpleNamespace(root_node=root)
    return [(kind, [n.id for n in nodes]) for kind, nodes in plan_victims(tree, SWA, FULL, settings(alpha), leaves)]


def _leaves(root):
    out, stack = [], [root]
    while stack:
        n = stack.pop()
        out += [n] if not n.children and n is not root else []
        stack += list(n.children.values())
    return out


def test_mellum_config_reads_as_an_swa_profile():
    profile = profile_for_swa(TINY_MELLUM)
    assert (profile.n_attention_layers, profile.n_swa_layers, profile.sliding_window) == (1, 3, WINDOW)
    assert profile.swa_kv_bytes_per_token == 3 * profile.kv_bytes_per_token


def test_stale_swa_goes_first_and_a_leaf_window_is_never_tombstoned():
    root = node(None, 0, t=0)
    old = node(root, 20, t=1)  # a single-child stretch far from any reuse point: stale
    near = node(old, 6, t=2)  # within the last window of the short leaf below
    leaf = node(near, 4, t=3)
    steps = plan(root)
    assert steps[0] == ("stale", [old.id])
    tombstoned = {i for kind, ids in steps if kind != "leaf" for i in ids}
    assert near.id not in tombstoned and leaf.id not in tombstoned
    assert ("leaf", [leaf.id]) in steps  # the branch goes whole instead


def test_branch_window_is_a_candidate_and_its_leaves_windows_are_not():
    root = node(None, 0, t=0)
    trunk = node(root, 30, t=5)  # ends at a branch point: its last WINDOW tokens are its window
    a = node(trunk, 20, t=6)
    b = node(trunk, 20, t=7)
    steps = plan(root)
    assert ("window", [trunk.id]) in steps
    assert ("leaf", [a.id]) in steps and ("leaf", [b.id]) in steps


def test_locked_windows_and_unevictable_leaves_are_left_alone():
    root = node(None, 0, t=0)
    trunk = node(root, 30, t=1, locked=True)
    a = node(trunk, 20, t=2, locked=True)
    b = node(trunk, 20, t=3)
    steps = plan(root, evictable=[b])
    assert steps == [("leaf", [b.id])]


@pytest.mark.parametrize("alpha, first", [(0.0, "older"), (100.0, "cheaper")])
def test_candidates_ranked_by_recency_and_flops_per_byte(alpha, first):
    # Two branches off the root: the older leaf is long (many FLOPs saved per byte of its KV),
    # the newer one short. LRU (alpha 0) takes the older; a large alpha the short one.
    root = node(None, 0, t=0)
    long_old = node(root, 400, t=1)
    short_new = node(root, 10, t=2)
    steps = plan(root, alpha=alpha)
    expected = long_old if first == "older" else short_new
    assert steps[0] == ("leaf", [expected.id])


def test_a_fault_is_reported_once_and_named():
    s = settings()
    s.faults.unrecoverable("plan", ValueError("boom"))
    s.faults.unrecoverable("plan", KeyError("later"))
    assert s.faulted == "plan: ValueError: boom"


# -- the incremental plan (policy/rules/window_plan.py) on the same stand-in nodes, no engine --------

class StandInView:
    """`WindowView` over the stand-in nodes; `gone` holds the ids taken out of the tree."""

    def __init__(self, evictable=None):
        self.evictable, self.gone = evictable, set()

    def live(self, n):
        cd = n.component_data[SWA]
        return cd.value is not None and cd.lock_ref == 0

    def evictable_leaf(self, n):
        return (not n.children) if self.evictable is None else any(n is e for e in self.evictable)

    def recency(self, n):
        return n.last_access_time

    def alive(self, n):
        return n.id not in self.gone


def bound_plan(root, alpha=1.0):
    from sglang_marconi.policy.rules.window_plan import WindowPlan

    plan = WindowPlan(WINDOW, StandInView(), settings(alpha).profile)
    plan.bind(root)
    return plan


@pytest.mark.parametrize("alpha", [0.0, 1.0, 100.0])
def test_incremental_plan_equals_the_reference_on_stand_in_trees(alpha):
    root = node(None, 0, t=0)
    trunk = node(root, 30, t=5)
    a = node(trunk, 20, t=6)
    b = node(trunk, 3, t=7)
    old = node(b, 20, t=1)
    node(old, 6, t=8)
    node(root, 400, t=2)
    plan = bound_plan(root, alpha)
    plan.check(alpha)
    first = plan_victims(SimpleNamespace(root_node=root), SWA, FULL, settings(alpha), _leaves(root))[0]
    kind, nodes = plan.next_victim(alpha)
    assert (kind, [n.id for n in nodes]) == (first[0], [n.id for n in first[1]])
    # A leaf goes (engine: delete it, then tell the plan), another grows under a branch point.
    plan.view.gone.add(a.id)
    del trunk.children[a.id]
    plan.removed(a)
    plan.check(alpha)
    c = node(trunk, 12, t=9)
    plan.added(c)
    c.component_data[SWA].lock_ref = 1
    plan.touched(c)
    plan.check(alpha)


def test_a_branch_point_that_loses_a_branch_leaves_a_stale_window_behind():
    # The trunk's window is a branch window while it has two children; once one goes, the other
    # is far below (its chain is longer than the window): the trunk's SWA KV is stale, first out.
    root = node(None, 0, t=0)
    trunk = node(root, 30, t=5)
    a = node(trunk, 20, t=6)
    b = node(trunk, 20, t=7)
    plan = bound_plan(root)
    assert plan.next_victim(1.0)[0] != "stale"
    plan.view.gone.add(a.id)
    del trunk.children[a.id]
    plan.removed(a)
    kind, nodes = plan.next_victim(1.0)
    assert (kind, [n.id for n in nodes]) == ("stale", [trunk.id])
    plan.check(1.0)
    trunk.component_data[SWA].value = None  # the engine tombstones it
    plan.touched(trunk)
    kind, nodes = plan.next_victim(1.0)
    assert (kind, [n.id for n in nodes]) == ("leaf", [b.id])
