"""The tree core's inline fast paths (an admission's new leaf with its end and branch states, an
unlock's candidate test) leave exactly what its general path leaves: on random streams, a cache
whose configuration keeps the core's hooks (so it takes the fast paths) and one that overrides them
with the same hooks (so it takes the general path) hit, admit, evict and leave the same tree,
clock, candidate slots and columns."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_shadow_cache import CHOICES, PREFIXES, TOY, requests

from sglang_marconi.policy.tree.shadow_cache import ShadowCache
from sglang_marconi.policy.tree.shared_match import SharedMatch
from sglang_marconi.policy.tuning.shadow_tuner import eviction_for


class GeneralPathCache(ShadowCache):
    """The same cache; its hooks, overridden by themselves, keep it off the core's inline paths."""

    def _add_leaf(self, parent, *edge):
        return super()._add_leaf(parent, *edge)

    def _refresh(self, node) -> None:
        super()._refresh(node)


def test_the_general_path_cache_takes_no_fast_path():
    assert ShadowCache._core_leaf and ShadowCache._core_refresh
    assert not GeneralPathCache._core_leaf and not GeneralPathCache._core_refresh


def contents(cache):
    snap = cache.snapshot()
    index = cache.index
    return (snap.parents, [(start, end) for _, start, end in snap.edges], snap.has_state, snap.last_access,
            snap.clock, snap.probation, cache.kv_tokens, cache.ssm_states, cache.counters,
            [(x.id, x.end) for x in index.items], index.recency, index.value)


def stream(reqs):
    """The requests' (input, sequence) in turn; a repeat serves the previous input again."""
    previous = None
    for p, suffix, out, repeat in reqs:
        inp = previous if repeat and previous is not None else PREFIXES[p] + suffix
        previous = inp
        yield inp, np.asarray(inp + out, dtype=np.int64)


@settings(max_examples=200, deadline=None)
@given(requests, st.integers(30, 400), st.sampled_from(CHOICES), st.sampled_from([1, 2]), st.sampled_from([1, 4]),
       st.sampled_from([None, 3, 5]), st.booleans())
def test_fast_paths_leave_what_the_general_path_leaves(reqs, capacity, choice, page, grid, slots, probation):
    caches = [kind(TOY, capacity if slots else max(capacity, 2 * TOY.ssm_state_bytes), eviction_for(choice),
                   checkpoint_grid=grid, page_size=page, state_slots=slots, probation=probation)
              for kind in (ShadowCache, GeneralPathCache)]
    for inp, seq in stream(reqs):
        answers = []
        for cache in caches:
            match = SharedMatch(seq, len(inp), page)
            hit, checkpoint_at = cache.lookup(match)
            answers.append((hit, checkpoint_at, cache.admit(match, checkpoint_at, len(inp))))
        assert answers[0] == answers[1]
        caches[0].check_invariants()
        assert contents(caches[0]) == contents(caches[1])
