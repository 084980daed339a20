"""Turns that resume where the previous input ended: keep that state, not the decode's. Engine-free;
one rule, written once.

Chat templates of reasoning models (DeepSeek-R1's, Qwen3's thinking templates) drop each answer's
reasoning from the history, and agent frameworks that strip earlier reasoning do the same. The
next turn then leaves the cached sequence where its predecessor's *input* ended: the state there
is what it resumes at, and the state after the decode is never reused. With probation
(`rules/probation.py`) the input-end state is probationary, evicted before any regular state, while
the unused final state is a regular one: under Mamba pressure every conversation loses the state
its next turn needs and keeps the one it does not.

The rule: a request whose match reuses a state kept at an earlier request's input end (such a
state is marked when it is inserted: `marks_input_end`) is taken for a turn of such a
conversation. Its own input-end state is kept as a regular state (`keeps_input_end_regular`) and
its final state goes on probation (`final_on_probation`). Every other request is served as before,
so a conversation that continues after its decode (it resumes at a final state) never turns the
rule on, and a turn the rule misjudges still has its final state while there is free room.

Only in extra_buffer (`applies`), SGLang's GPU default: there an extend snapshots states on a
fixed grid and a turn that lost its predecessor's input-end state resumes a chunk or more back. In
no_buffer two-pass prefill ends a chunk at the branch, the previous input's end, so a branch state
sits there anyway; at SGLang's default memory split the reasoning trace gains nothing from the rule
there, while the stress harness loses 0.5 (alpha 0) to 2.3 points (tuned) with it
(docs/benchmarks.md). It gains there only where the Mamba pool alone is short.

Callers: the simulator's model of the served cache (`policy/tree/served_cache.py`) and the served
admission (`serving/admission.py`), each with its own request's fields.
"""

from __future__ import annotations


def applies(extra_buffer: bool, probation: bool) -> bool:
    """Whether a cache runs the rule: extra_buffer, with probation (without it no input-end state
    is kept to resume at, nor a final state put on probation)."""
    return extra_buffer and probation


def marks_input_end(finished: bool, checkpoint_end: int, input_len: int) -> bool:
    """Is a new state inserted by this checkpoint an input-end state? The checkpoint of the
    request's last prefill extend (the one ending at its input), not its release."""
    return not finished and checkpoint_end == input_len


def keeps_input_end_regular(resumed_input_end: bool, checkpoint_end: int, input_len: int,
                            position: int | None) -> bool:
    """Does this checkpoint keep its state (at `position`) as a regular state, a request that
    resumed at an input-end state reaching the end of its own input?"""
    return (resumed_input_end and checkpoint_end == input_len and position is not None and position > 0)


def final_on_probation(resumed_input_end: bool) -> bool:
    """Does the request's final state go on probation?"""
    return resumed_input_end
