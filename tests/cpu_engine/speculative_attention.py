"""Test-only stand-in: speculative decoding (EAGLE / NEXTN, a chain of drafts: `--speculative-eagle-topk
1`) on SGLang's torch_native attention backend, which 0.5.23 does not wire for it.

SGLang runs EAGLE on CPU only through its AMX backend (`intel_amx`), whose sgl-kernel CPU ops the
package registry does not carry, and which the server swaps for torch_native on a host without
them (`arg_groups/overrides._attention_backend_platform_fallbacks`). torch_native lacks two things
speculative decoding needs; both are supplied here, for a chain of drafts only (topk 1: each
draft token attends to the committed prefix and the drafts before it, which is plain causal
attention; a tree of drafts needs a custom mask and is refused):

- target verify (`ForwardMode.TARGET_VERIFY`): the batch carries no extend lengths; each
  request extends by `spec_info.draft_token_num` tokens after its `seq_lens` committed ones (the
  lengths the AMX backend derives the same way, `IntelAMXAttnBackend._build_extend_metadata`),
  so `forward_extend` runs as an extend of exactly that shape;
- the draft model's backends (`DraftBackendFactory`, which has no torch_native entry): draft
  extend is a plain torch_native backend; draft decode is one torch_native backend per draft step
  but the last, step i reading the committed prefix plus the i + 1 drafts written so far
  (`seq_lens + i + 1` slots of the request's `req_to_token` row, where SGLang allocated the
  drafts' slots; `IntelAMXMultiStepDraftBackend` reads the same).

Checked end to end against SGLang's own non-speculative path on the same engine
(`tests/server/test_live_speculative.py`): with `--speculative-algorithm NEXTN` every output, cold
and warm, equals the output of the same model served without speculative decoding, token for
token and logprob for logprob (bitwise), with drafts both accepted and rejected; a wrong verify
mask, length or draft step would change a logit.
"""

from __future__ import annotations

import torch

TORCH_NATIVE_MODULE = "sglang.srt.layers.attention.torch_native_backend"
DRAFT_UTILS_MODULE = "sglang.srt.speculative.draft_utils"


def _chain_only(spec_info) -> int:
    """The verify width of a chain of drafts; refuse a tree (it needs a custom mask)."""
    topk = getattr(spec_info, "topk", 1)
    if topk not in (1, None):
        raise NotImplementedError(f"torch_native speculative stand-in: draft trees (topk {topk}) need a custom mask")
    return int(spec_info.draft_token_num)


def _verify_as_extend(module):
    """`TorchNativeAttnBackend.forward_extend` runs a target verify as an extend of
    `draft_token_num` tokens after each request's committed `seq_lens`."""
    backend = module.TorchNativeAttnBackend
    original = backend.forward_extend

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        width = _chain_only(forward_batch.spec_info)
        saved = forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.seq_lens
        committed = forward_batch.seq_lens
        forward_batch.extend_prefix_lens = committed
        forward_batch.extend_seq_lens = torch.full_like(committed, width)
        forward_batch.seq_lens = committed + width
        try:
            return original(self, q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        finally:
            forward_batch.extend_prefix_lens, forward_batch.extend_seq_lens, forward_batch.seq_lens = saved

    backend.forward_extend = forward_extend


class TorchNativeMultiStepDraftBackend:
    """One torch_native backend per draft decode step but the last (SGLang samples the last
    step's token without a forward); step i attends to `seq_lens + i + 1` slots."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        if topk != 1:
            raise NotImplementedError(f"torch_native speculative stand-in: draft trees (topk {topk})")

        class DraftStepBackend(TorchNativeAttnBackend):
            def __init__(self, runner, drafts_written: int):
                super().__init__(runner)
                self.drafts_written = drafts_written

            def _run_sdpa_forward_decode(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                                         seq_lens, *args, **kwargs):
                return super()._run_sdpa_forward_decode(query, output, k_cache, v_cache, req_to_token,
                                                        req_pool_indices, seq_lens + self.drafts_written,
                                                        *args, **kwargs)

        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends = [DraftStepBackend(model_runner, step + 1) for step in range(speculative_num_steps - 1)]

    def init_forward_metadata(self, forward_batch):
        for backend in self.attn_backends:
            backend.init_forward_metadata(forward_batch)


def _draft_backends_on_torch_native(module):
    """`DraftBackendFactory` builds the torch_native draft backends above for a runner whose
    draft attention backend is torch_native; every other backend is SGLang's."""
    factory = module.DraftBackendFactory
    create_decode, create_extend = factory.create_decode_backend, factory.create_draft_extend_backend

    def backend_type(self, phase: str) -> str:
        from sglang.srt.runtime_context import attention_backends

        prefill, decode = attention_backends()
        return self.draft_attn_backend or (decode if phase == "decode" else prefill)

    def stamped(backend):
        backend.prefill_attention_backend_str = backend.decode_attention_backend_str = "torch_native"
        return backend

    def create_decode_backend(self):
        if self.speculative_num_steps <= 1 or backend_type(self, "decode") != "torch_native":
            return create_decode(self)
        backend = stamped(TorchNativeMultiStepDraftBackend(self.draft_model_runner, self.topk,
                                                           self.speculative_num_steps))
        for child in backend.attn_backends:
            stamped(child)
        return backend

    def create_draft_extend_backend(self):
        from sglang.srt.runtime_context import get_spec

        phase = "decode" if get_spec().speculative_attention_mode == "decode" else "prefill"
        if backend_type(self, phase) != "torch_native":
            return create_extend(self)
        from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

        return stamped(TorchNativeAttnBackend(self.draft_model_runner))

    factory.create_decode_backend = create_decode_backend
    factory.create_draft_extend_backend = create_draft_extend_backend


def _cuda_synchronize_is_a_no_op_without_a_gpu(torch_module):
    """`Qwen3NextForCausalLM.set_embed_and_head` (the MTP draft sharing the target's embedding and
    LM head) calls `torch.cuda.synchronize()` on every platform; with no GPU there is no device
    work to wait for."""
    original = torch_module.cuda.synchronize

    def synchronize(*args, **kwargs):
        if not torch_module.cuda.is_available():
            return None
        return original(*args, **kwargs)

    torch_module.cuda.synchronize = synchronize


PATCHES = {
    "torch": _cuda_synchronize_is_a_no_op_without_a_gpu,
    TORCH_NATIVE_MODULE: _verify_as_extend,
    DRAFT_UTILS_MODULE: _draft_backends_on_torch_native,
}
