"""Online tuning of the eviction choice: shadow caches on a sample of sessions (`sampling`), the evidence
that one choice leads another (`evidence`), the tuners (`shadow_tuner`, `window_tuner`) and the picklable
description a served runtime builds them from (`tuner_spec`)."""
