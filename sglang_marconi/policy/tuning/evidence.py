"""What the tuner's caches saved, and whether one choice's lead over another is real evidence.

`Evidence` keeps, per arm (a candidate choice's cache), exponentially decayed sums of what it saved
on each request over a long and a short window, with session-clustered second moments and
split-half sums to judge a lead (`Evidence.lead`). The shadow tuner (`shadow_tuner.py`) and the
sliding-window tuner (`window_tuner.py`) decide on it.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from sglang_marconi.policy.tuning.sampling import session_in_sample

LONG, SHORT = 0, 1  # the two windows of `Evidence`


class Evidence:
    """Decayed per-arm sums of what each arm saved, over two windows (half-lives in added
    requests), with what is needed to judge a lead beyond the requests it came from:

    - session-clustered second moments: `M[w] = sum over clusters c of D_c D_c^T`, D_c a
      cluster's decayed per-arm sums, so Var(S_a - S_b) ~ M_aa + M_bb - 2 M_ab treats a cluster
      as one observation. A cluster is a block of `block` consecutive requests of one session:
      a session's requests are correlated (one conversation that one arm keeps is one piece of
      evidence, not forty), while a long session that keeps gaining block after block is
      evidence that holds over time;
    - the same sums split into two halves of the clusters (a salted hash): a lead must hold in
      both, not come from a handful of sessions on one side."""

    _PRUNE_EVERY = 4096

    def __init__(self, k: int, half_lives: tuple[float, ...], block: int = 8):
        """One window per half-life (math.inf: no decay)."""
        self._setup(k, np.array([0.5 ** (1.0 / h) for h in half_lives]), block)

    def _setup(self, k: int, decay: np.ndarray, block: int) -> None:
        self.k, self.block, self.decay = k, block, decay
        w = len(decay)
        # potential, the halves' sums, scores and moments are views into one buffer, so that one
        # multiply decays them all (the same product per value as decaying each: moments by d x d)
        # and one add adds a request's terms to them all (`_addends`). Laid out as potential,
        # half 0, scores, half 1, moments: the scores and the half a request adds to are then one
        # block either way.
        wk = w * k
        sizes = (w, wk, wk, wk, w * k * k)
        self._buf = np.zeros(sum(sizes))
        self.potential = self._buf[:w]
        self.scores = self._buf[w + wk : w + 2 * wk].reshape(w, k)
        # halves[window, half, arm]: the two half blocks on either side of the scores
        self.halves = self._buf[w : w + 3 * wk].reshape(3, w, k)[::2].transpose(1, 0, 2)
        self.moments = self._buf[w + 3 * wk :].reshape(w, k, k)
        self._buf_decay = np.concatenate((decay, np.tile(np.repeat(decay, k), 3), np.repeat(decay * decay, k * k)))
        # One request's terms, laid out as the buffer, for a request in either half: its potential,
        # its gains on the scores and on its half (the other half's block stays zero: adding 0.0
        # to a sum of gains changes no value), and gains x gains on the moments.
        self._addends = []
        for half in (0, 1):
            terms = np.zeros_like(self._buf)
            rows = terms[w + wk : w + 2 * wk].reshape(w, k)  # the gains once per window
            self._addends.append((terms, terms[:w], terms[w + half * wk : w + (half + 2) * wk].reshape(2, w, k),
                                  rows, rows[:, :, None], terms[w + 3 * wk :].reshape(w, k, k)))
        self._cross = np.empty((w, k, k))  # a cluster's decayed sums x gains, and it plus its transpose
        self._cross_sum = np.empty((w, k, k))
        self._cross_t = self._cross.transpose(0, 2, 1)
        self.sessions: dict[str, tuple[np.ndarray, int, int, int]] = {}  # key -> (D (2, k), t, half, requests)
        self.t = 0
        self._decays: dict[int, np.ndarray] = {}

    def add(self, session_key: str, gains: np.ndarray, whole: float) -> None:
        """One request's gains per arm (and what it could have saved at most). Each value gets the
        same floating-point operations in the same order as a plain per-array update would apply
        (decay, then this request's terms: its gains, gains x gains, then its cluster's cross
        terms), so the sums do not depend on how they are batched."""
        self.t += 1
        entry = self.sessions.get(session_key)
        n = 0 if entry is None else entry[3]
        if n % self.block == 0:  # a new cluster: the session's next block of requests
            half = int(session_in_sample(f"{session_key}\0{n // self.block}", 0.5, salt=1))
        else:
            stored, t_s, half, _ = entry
        terms, potential, gained, rows, rows_column, products = self._addends[half]
        gained[:] = gains  # the scores and this half, once per window
        potential.fill(whole)
        np.multiply(rows_column, gains, products)  # gains x gains, per window
        buf = self._buf
        buf *= self._buf_decay
        buf += terms
        if n % self.block == 0:
            total = rows.copy()
        else:
            total = stored  # the session's own array: decayed to now, then this request added
            total *= self._decay_over(self.t - t_s)
            cross = self._cross
            np.multiply(total[:, :, None], gains, cross)
            np.add(cross, self._cross_t, self._cross_sum)
            self.moments += self._cross_sum
            total += rows
        self.sessions[session_key] = (total, self.t, half, n + 1)
        if self.t % self._PRUNE_EVERY == 0:
            self._prune()

    def _decay_over(self, requests: int) -> np.ndarray:
        """(decay ** requests) as a column, remembered: sessions come back at recurring gaps."""
        column = self._decays.get(requests)
        if column is None:
            if len(self._decays) > 4096:
                self._decays.clear()
            column = self._decays[requests] = (self.decay ** requests)[:, None]
        return column

    def _prune(self) -> None:
        # a session idle for ~13 long half-lives weighs < 1e-4 of its prime: forget it (its share of
        # `moments` stays, decaying; were it to come back it would start from zero)
        if self.decay[LONG] >= 1.0:
            return
        horizon = math.log(1e-4) / math.log(self.decay[LONG])
        self.sessions = {s: e for s, e in self.sessions.items() if self.t - e[1] < horizon}

    def copy_arm(self, src: int, dst: int) -> None:
        """Arm `dst`'s evidence becomes arm `src`'s (as if it had saved what `src` did)."""
        self.scores[:, dst] = self.scores[:, src]
        self.halves[:, :, dst] = self.halves[:, :, src]
        m = self.moments
        m[:, dst, :] = m[:, src, :]
        m[:, :, dst] = m[:, :, src]
        for d, _, _, _ in self.sessions.values():
            d[:, dst] = d[:, src]

    def select(self, arms: Sequence[int]) -> Evidence:
        """The same evidence restricted to `arms` (in that order)."""
        idx = np.asarray(arms)
        out = self._like(len(idx))
        out.t = self.t
        out.scores[:], out.potential[:] = self.scores[:, idx], self.potential
        out.moments[:] = self.moments[:, idx][:, :, idx]
        out.halves[:] = self.halves[:, :, idx]
        out.sessions = {s: (d[:, idx].copy(), t, h, n) for s, (d, t, h, n) in self.sessions.items()}
        return out

    def extended(self) -> Evidence:
        """The same evidence with one more arm, which has saved nothing so far."""
        k = self.k
        out = self._like(k + 1)
        out.t = self.t
        out.scores[:, :k], out.potential[:] = self.scores, self.potential
        out.moments[:, :k, :k], out.halves[:, :, :k] = self.moments, self.halves
        for s, (d, t, h, n) in self.sessions.items():
            out.sessions[s] = (np.concatenate((d, np.zeros((d.shape[0], 1))), axis=1), t, h, n)
        return out

    def _like(self, k: int) -> Evidence:
        out = Evidence.__new__(Evidence)
        out._setup(k, self.decay, self.block)
        return out

    def lead(self, a: int, b: int, window: int, margin: float, z: float, halves: bool = True) -> bool:
        """Whether arm `a` leads arm `b` in `window` by more than `margin` x potential, by more than
        `z` clustered standard errors, and (`halves`) in both halves of the clusters. (Values read
        as Python floats: the same double arithmetic as on numpy's scalars, for less per read.)"""
        score = self.scores.item
        gap = score(window, a) - score(window, b)
        if gap <= margin * self.potential.item(window):
            return False
        m = self.moments.item
        if gap <= z * math.sqrt(max(m(window, a, a) + m(window, b, b) - 2 * m(window, a, b), 0.0)):
            return False
        if not halves:
            return True
        h = self.halves.item
        return h(window, 0, a) > h(window, 0, b) and h(window, 1, a) > h(window, 1, b)


class GuardSums:
    """What the guard judges: `Evidence` over one undecayed window since the last switch, kept
    only for the two arms the guard compares, the safe choice (arm 0) and the current one.

    The shadow tuner resets these sums at every switch, and between switches the guard reads
    only `lead(0, current)`; the other arms' sums would never be read before the next reset, so
    they are not kept. The two arms' sums are plain floats updated with the same operations, in
    the same order, as `Evidence.add` applies to them (an undecayed window multiplies by 1.0,
    which changes nothing), so `lead` answers exactly as the full `Evidence` would."""

    def __init__(self, current: int, block: int = 8):
        self.arms = (0, current)
        self.block = block
        self.scores = [0.0, 0.0]
        self.potential = 0.0
        self.moments = [0.0, 0.0, 0.0]  # M[0,0], M[cur,cur], M[0,cur]
        self.halves = [[0.0, 0.0], [0.0, 0.0]]  # [half][arm]
        self.sessions: dict[str, tuple[float, float, int, int]] = {}  # key -> (D_0, D_cur, half, requests)
        self.t = 0

    def add(self, session_key: str, gains: np.ndarray, whole: float) -> None:
        self.t += 1
        a, b = self.arms
        ga, gb = float(gains.item(a)), float(gains.item(b))
        s, m = self.scores, self.moments
        s[0] += ga
        s[1] += gb
        self.potential += whole
        m[0] += ga * ga
        m[1] += gb * gb
        m[2] += ga * gb
        entry = self.sessions.get(session_key)
        n = 0 if entry is None else entry[3]
        if n % self.block == 0:  # a new cluster (as `Evidence.add` numbers and halves them)
            half = int(session_in_sample(f"{session_key}\0{n // self.block}", 0.5, salt=1))
            da, db = ga, gb
        else:
            pa, pb, half, _ = entry  # undecayed: the cluster's sums as stored
            m[0] += pa * ga + pa * ga
            m[1] += pb * gb + pb * gb
            m[2] += pa * gb + pb * ga
            da, db = pa + ga, pb + gb
        h = self.halves[half]
        h[0] += ga
        h[1] += gb
        self.sessions[session_key] = (da, db, half, n + 1)

    def lead(self, a: int, b: int, window: int, margin: float, z: float, halves: bool = True) -> bool:
        """`Evidence.lead` for the safe choice over the current one (the only pair kept)."""
        assert (a, b) == self.arms and window == LONG, "the guard compares the safe choice with the current one"
        gap = self.scores[0] - self.scores[1]
        if gap <= margin * self.potential:
            return False
        m = self.moments
        if gap <= z * math.sqrt(max(m[0] + m[1] - 2 * m[2], 0.0)):
            return False
        h = self.halves
        return not halves or bool(h[0][0] > h[0][1] and h[1][0] > h[1][1])

    def copy_arm(self, src: int, dst: int) -> None:
        """`Evidence.copy_arm`; only a copy onto one of the two kept arms changes anything."""
        if dst not in self.arms or src == dst:
            return
        assert src in self.arms, "only the kept arms' sums are known"
        i, j = self.arms.index(src), self.arms.index(dst)
        s, m, h = self.scores, self.moments, self.halves
        s[j] = s[i]
        for half in h:
            half[j] = half[i]
        m[0] = m[1] = m[2] = m[i]  # both arms now hold the same sums: every moment is arm i's own
        self.sessions = {key: (e[i], e[i], e[2], e[3]) for key, e in self.sessions.items()}
