"""What online tuning costs the simulator: a tuned replay against a fixed-choice replay, with the
shadow tuner as it is and as it was before its shadows shared their work (the frozen reference in
`tests/reference_shadow_tuner.py`), all in this process, interleaved.

    python scripts/bench_tuning_cost.py [--quick] [--cells synthetic:sharegpt@1,mooncake@100] [--repeat 3]

Per cell (a workload at a capacity, paper-7b, the automatic sample rate as `bench_policies.py` uses):
the fixed-choice replay is the median over the tuner's candidate choices of a replay with that choice
fixed (`bench_policies.py`'s baseline); each replay is timed `--repeat` times, rounds interleaved, and
the least time counts (CPU seconds of this process, and wall seconds). Both tuners must make the
same decisions (checked: the same choices at the same requests, and bit-identical evidence at the end).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from sglang_marconi.policy.cost.model_profile import load_profile
from sglang_marconi.policy.tuning.shadow_tuner import ShadowConfig, eviction_for
from sglang_marconi.sim.baselines.hybrid_radix import HybridRadixPolicy
from sglang_marconi.sim.policies import build_policy
from sglang_marconi.sim.replay import replay
from sglang_marconi.sim.traces import load_workload
from sglang_marconi.sim.tuning import shadow_config_for

REPO = Path(__file__).resolve().parents[1]
MOONCAKE = REPO.parent / "shared/data/mooncake/conversation_trace.jsonl"
sys.path.insert(0, str(REPO / "tests"))
import reference_shadow_tuner as reference  # noqa: E402  (the tuner before this restructuring)

# bench_policies.py --quick's cells (its sweeps, every other capacity), then the demo's (scripts/demo.sh)
QUICK = ["synthetic:swe-agent@2", "synthetic:swe-agent@10", "synthetic:swe-agent@40", "synthetic:lmsys@2",
         "synthetic:lmsys@10", "synthetic:sharegpt@1", "synthetic:sharegpt@5", "synthetic:system-prompt@0.2",
         "synthetic:system-prompt@1", "mooncake@100", "mooncake@1000", "mooncake-blocks@100", "mooncake-blocks@1000"]
DEMO = ["synthetic:swe-agent@5", "synthetic:swe-agent@20"]  # the demo's 2 and 10 GB are among QUICK's


class ReferenceTuner:
    """The frozen reference behind the package tuner's interface (it joins the tokens itself)."""

    def __init__(self, tuner):
        self.tuner = tuner
        self.log = tuner.log
        self.current = tuner.current
        self.record = None  # the reference has no depth choices, so no record of finished sequences

    def observe(self, session_key, input_tokens, output_tokens, *, sequence=None):
        choice = self.tuner.observe(session_key, input_tokens, output_tokens)
        self.current = self.tuner.current
        return choice


def load(name: str):
    if name.startswith("mooncake"):
        return load_workload(str(MOONCAKE), "blocks" if name == "mooncake-blocks" else "conversation")
    return load_workload(name)


def timed(run) -> tuple[float, float, object]:
    cpu, wall = time.process_time(), time.perf_counter()
    result = run()
    return time.process_time() - cpu, time.perf_counter() - wall, result


def cell(name: str, capacity_gb: float, repeat: int) -> dict:
    workload, profile = load(name), load_profile("paper-7b")
    cap = int(capacity_gb * 1e9)
    config = shadow_config_for(workload, profile, cap, ShadowConfig(), None, depth=False)  # the reference's choices

    def fixed(choice):
        return replay(workload, HybridRadixPolicy("fixed", profile, cap, eviction_for(choice)), profile, cap,
                      progress=False)

    def tuned(old: bool):
        policy = build_policy("marconi", profile, cap, tuning=config)
        if old:
            policy.tuner = ReferenceTuner(reference.ShadowTuner(profile, cap, reference.ShadowConfig(**{k: v for k, v in config.__dict__.items() if k in reference.ShadowConfig.__dataclass_fields__})))
        run = replay(workload, policy, profile, cap, progress=False)
        tuner = policy.tuner.tuner if old else policy.tuner
        ev = tuner.evidence
        return run.choice_history(), [getattr(ev, f).tolist() for f in ("scores", "potential", "moments", "halves")]

    best: dict[str, list[float]] = {}
    histories = {}
    for _ in range(repeat):
        for label, run in [(f"fixed {c}", lambda c=c: fixed(c)) for c in config.choices] + [
                ("tuned", lambda: tuned(False)), ("tuned before", lambda: tuned(True))]:
            cpu, wall, result = timed(run)
            old = best.get(label, [float("inf")] * 2)
            best[label] = [min(old[0], cpu), min(old[1], wall)]
            if label.startswith("tuned"):
                histories[label] = result
    assert histories["tuned"] == histories["tuned before"], f"{name}@{capacity_gb}: the tuners decided differently"
    histories = {label: history for label, (history, _) in histories.items()}
    fixed_cpu = statistics.median(v[0] for k, v in best.items() if k.startswith("fixed"))
    fixed_wall = statistics.median(v[1] for k, v in best.items() if k.startswith("fixed"))
    return {"cell": f"{name} @ {capacity_gb:g} GB", "requests": len(workload), "rate": config.sample_rate,
            "fixed": (fixed_cpu, fixed_wall), "after": tuple(best["tuned"]), "before": tuple(best["tuned before"]),
            "choices": " > ".join(dict.fromkeys(c for _, c in histories["tuned"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", help="comma list of WORKLOAD@GB (default: bench_policies --quick's and the demo's)")
    ap.add_argument("--quick", action="store_true", help="bench_policies --quick's cells only")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    cells = args.cells.split(",") if args.cells else QUICK + ([] if args.quick else DEMO)
    print("| cell | requests | sample rate | fixed s (CPU / wall) | tuned before s | tuned after s "
          "| before / fixed (CPU / wall) | after / fixed (CPU / wall) | after <= 2x (CPU) | choices |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    misses = []
    for spec in cells:
        name, gb = spec.rsplit("@", 1)
        if name.startswith("mooncake") and not MOONCAKE.exists():
            print(f"| {spec} | (no {MOONCAKE}) |")
            continue
        r = cell(name, float(gb), args.repeat)
        f, b, a = r["fixed"], r["before"], r["after"]
        ok = a[0] / f[0] <= 2.0  # CPU: the ratio other jobs on a shared machine do not distort
        misses += [] if ok else [r["cell"]]
        print(f"| {r['cell']} | {r['requests']} | {r['rate']:.2g} | {f[0]:.3f} / {f[1]:.3f} | {b[0]:.3f} / {b[1]:.3f} "
              f"| {a[0]:.3f} / {a[1]:.3f} | {b[0] / f[0]:.1f}x / {b[1] / f[1]:.1f}x | {a[0] / f[0]:.1f}x / {a[1] / f[1]:.1f}x "
              f"| {'yes' if ok else 'NO'} | {r['choices']} |", flush=True)
    print(f"\ntuned/fixed CPU <= 2x: {len(cells) - len(misses)} of {len(cells)} cells"
          + (f" (missed: {', '.join(misses)})" if misses else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
