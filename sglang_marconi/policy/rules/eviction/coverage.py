"""Coverage eviction: SGLang PR #38000's rule ("thin cached Mamba states by coverage instead of
evicting the LRU tail"), written from the PR's description, on Marconi's candidates.

The PR's diagnosis: an LRU over states evicts a path's states shallow-first (they were cached
first), the inverse of what a request that shares a long prefix and diverges mid-way needs: the
state at or just above its divergence point. Its rule picks the victim by how much of the tree
each state covers instead. We read "covers" as: the positions of the tree at which a request
leaving the tree would resume from this state, i.e. the node's own end and every position below
it down to (not including) the next states:

    coverage(n) = 1 + U(n),   U(n) = sum over children c of (len(c) - 1 if c holds a state
                                                             else len(c) + U(c))

for a node holding a state (0 for one without: nothing resumes from it). The candidate covering
the least goes first; ties (every leaf covers one position) go to the least recently used. On
Marconi's tree (states only at branch points and request ends) a leaf covers 1, a single-child
state the tokens down to the next state, so a chain is thinned from its deep end and the shallow
states a fork needs outlive it, as the PR reports (a fork at 8,192 tokens that LRU missed hits).
Where our reading may differ from the PR's code: we rank all of Marconi's candidates, not an LRU-tail
window, and a hit refreshes only the node hit (as SGLang 0.5.23's Mamba component does).

Served version, per node: its edge length, whether it holds a state, and U(n), kept
incrementally: adding, removing, splitting or merging an edge, or adding or dropping a state,
changes U of the nearest ancestor holding a state (and of the stateless nodes between), by the
edge-length delta; `HybridPrefixCache` re-scores that ancestor on every such change
(`value_reaches_up`), which is all the served index needs to do as well.
"""

from __future__ import annotations

import numpy as np

from sglang_marconi.policy.tree.candidate_index import CandidateIndex
from sglang_marconi.policy.rules.eviction.base import EvictionPolicy


class CoverageEviction(EvictionPolicy):
    name = "coverage"
    evicts_single_child_nodes = True
    refresh_matched_path = False
    # A node's value depends on its subtree: a change below it re-scores its nearest stated ancestor.
    value_reaches_up = True

    @staticmethod
    def node_value(cache, node) -> float:
        stated = cache.attention_only
        if not (node.has_state or stated):
            return 0.0
        return float(1 + uncovered_below(node, stated))

    def choose(self, candidates: CandidateIndex):
        return lowest_coverage(candidates)


def lowest_coverage(candidates: CandidateIndex):
    """The candidate covering the fewest positions; ties to the least recently used, then to the
    smallest tie key (`CandidateIndex`: the same on every rank, whatever the slots)."""
    n = len(candidates)
    value = candidates.efficiency[:n]
    ties = np.flatnonzero(value == value.min())
    if len(ties) > 1:
        recency = candidates.last_access[ties]
        ties = ties[recency == recency.min()]
        if len(ties) > 1:
            return candidates.items[candidates.least_key(ties)]
    return candidates.items[int(ties[0])]


def lowest_coverage_of(items: list, values: list, recency: list, tie_key):
    """`lowest_coverage`'s choice over parallel lists (a handful of candidates, no index): the
    least value, then the least recency, then the smallest `tie_key(item)`."""
    return items[min(range(len(items)), key=lambda i: (values[i], recency[i], tie_key(items[i])))]


def uncovered_below(node, every_node_stated: bool = False, has_state=None, edge_length=None) -> int:
    """U(node): positions below `node` whose nearest state at or above them is `node`'s.
    `has_state(n)` / `edge_length(n)` read another tree's nodes (the served index reads SGLang's);
    the defaults read the policy core's."""
    has_state = has_state or (lambda n: n.has_state)
    edge_length = edge_length or (lambda n: len(n.tokens))
    total, stack = 0, list(node.children.values())
    while stack:
        child = stack.pop()
        if every_node_stated or has_state(child):
            total += edge_length(child) - 1
        else:
            total += edge_length(child)
            stack.extend(child.children.values())
    return total


def coverage_value(node, has_state=None, edge_length=None) -> float:
    """The rule's value of a node holding a state: the positions a request leaving the tree would
    resume from its state (its own end and U below it); the readers as `uncovered_below`'s."""
    return float(1 + uncovered_below(node, has_state=has_state, edge_length=edge_length))
