"""Marconi's victim order under SWA-pool pressure (`serving/swa_component.plan_victims`), on small
trees of stand-in nodes shaped like SGLang's (`key`, `children`, `parent`, per-component data):
stale windows first, never a tombstone inside a branch's last window (SGLang #35515), branch-point
windows and leaves ranked by recency + alpha x FLOPs saved per byte, locked data never touched."""

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
    s.fault(ValueError("boom"))
    s.fault(KeyError("later"))
    assert s.faulted == "ValueError('boom')"
