"""The simulator adopts a tuned choice at the request the server does, switch after switch.

The served runtime's tuning protocol (`serving/runtime.py`): every release fed to the tuner keyed by
the session the client names, only the sessions of its sample handed over (`tuner_reads`), and at
sync point k (release k x sync_every) the tuner's choice as of sync point k - 1 adopted. The
simulator's model of the served cache (`sim/baselines/served.py`) must do the same: a key, a
sample or a sync point apart, and its tuner switches at other requests and its hits part from the
server's from there on.

- `test_simulator_adopts_where_the_server_does`: SGLang's real cache with the `marconi` backend
  and its inline tuner, against the simulator (`scripts/check_sim_vs_served.py`), on short traces
  whose tuner switches early and more than once: the same choices at the same requests, every
  request's hit identical.
- `test_background_tuner_adopts_where_the_simulator_does_when_sampling`: at a sample rate below 1
  the server's background tuner (its child process, fed the sampled sessions only) against the
  simulator's tuner, on one stream: the same adoptions at the same requests.
"""

import numpy as np
import pytest

pytest.importorskip("sglang")

from sglang_marconi.policy.cost.model_profile import load_profile  # noqa: E402
from sglang_marconi.policy.tree.served_cache import ServedPools  # noqa: E402
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, choice_label  # noqa: E402
from sglang_marconi.policy.tuning.tuner_spec import TunerSpec  # noqa: E402
from sglang_marconi.sim.baselines.served import ServedPolicy  # noqa: E402
from sglang_marconi.sim.synthetic import generate  # noqa: E402
from test_sim_equivalence import _check_script  # noqa: E402

PROFILE = load_profile("nemotron-h-8b")


# (kind, generator parameters, KV tokens, Mamba slots, strategy, chunk, probation, sync_every, switches
# at least): tight pools on which the tuned choice switches early (measured: seglen:100 at request 40,
# then alpha 20 at 176; alpha 100 at 120).
SWITCHING = {
    "lmsys-nobuf-probation": ("lmsys", dict(sessions=20, scale=0.1, seed=4), 3000, 10, "no_buffer", 256, True, 8, 2),
    "lmsys-xbuf": ("lmsys", dict(sessions=20, scale=0.1, seed=8), 3000, 10, "extra_buffer", 256, False, 8, 1),
}


@pytest.mark.parametrize("name", list(SWITCHING))
def test_simulator_adopts_where_the_server_does(name):
    kind, params, kv, slots, strategy, chunk, probation, sync_every, switches = SWITCHING[name]
    requests = list(generate(kind, **params))
    report = _check_script().run(requests, "nemotron-h-8b", kv, slots, strategy, chunk, "auto", probation,
                                 workload_name=name, sync_every=sync_every)
    print("\n".join(report.lines()))
    served, sim = report.config["served_choices"], report.config["sim_choices"]
    assert sim == served
    assert report.agree == report.requests, "\n".join(report.lines())
    assert len(served) >= switches and served[0][0] <= 16 * sync_every, f"the tuner must switch early: {served}"


def test_background_tuner_adopts_where_the_simulator_does_when_sampling():
    from sglang_marconi.serving.background_tuner import BackgroundShadowTuner

    sync_every = 8
    pools = ServedPools(4000, 10)
    config = ShadowConfig(sample_rate=0.5)
    requests = list(generate("lmsys", sessions=40, scale=0.1, seed=3))
    sim = ServedPolicy("marconi", PROFILE, pools, tuning=config, probation=True, sync_every=sync_every)
    tuner = BackgroundShadowTuner(TunerSpec("hybrid", PROFILE, 1, config, dict(probation=True, served=pools)),
                                  sync_every=sync_every, put_wait_s=60.0)
    served, in_force = [], config.start
    try:
        for i, r in enumerate(requests, 1):
            sim.serve(r)
            tuner.observe(r.session_id, r.input_tokens, np.asarray(r.output_tokens)[:-1])
            if i % sync_every == 0:  # the runtime's sync point: the verdict as of the previous one
                tuner.mark_sync()
                decided = tuner.choice_at(i // sync_every - 1, wait_s=None)
                assert tuner.failed is None, tuner.failed
                if decided != in_force:
                    in_force = decided
                    served.append((i, choice_label(decided)))
    finally:
        tuner.close()
    simulated = [(at, choice_label(c)) for at, c in sim.history[1:]]
    assert served, "the tuner never switched: the test would prove nothing"
    assert simulated == served
