"""Plain-torch stand-ins for the GPU-only kernels SGLang 0.5.23's CPU engine calls for hybrid
models on a host without a GPU (or AMX): one module per kernel family.

Each public function keeps the signature and in-place side effects of the SGLang kernel it
replaces, so it can be bound in that kernel's place (see `../sitecustomize.py`). They compute in
float32, vectorised across heads and channels; only recurrences loop over chunks or tokens.
Test infrastructure only: the package `sglang_marconi` never imports them.
"""

PAD_SLOT_ID = -1  # SGLang's marker for a batch row without a state slot (skipped, never written)
