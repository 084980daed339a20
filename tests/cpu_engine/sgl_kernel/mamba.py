"""`sgl_kernel.mamba` of the CPU build: the conv and gated-delta-rule ops, with the CPU ops'
argument order, computed by `torch_kernels`."""

from torch_kernels import conv1d, gated_delta_rule


def causal_conv1d_fn_cpu(x, weight, bias, activation, conv_states, has_initial_state,
                         cache_indices, query_start_loc, seq_lens_cpu=None):
    """Prefill conv over concatenated sequences; see `conv1d.causal_conv1d_fn`."""
    return conv1d.causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, seq_lens_cpu,
                                   cache_indices=cache_indices, has_initial_state=has_initial_state,
                                   activation=activation)


def causal_conv1d_update_cpu(x, conv_states, weight, bias, activation, conv_state_indices, **speculative):
    """Decode conv step (and speculative verify's, with its intermediate windows); see
    `conv1d.causal_conv1d_update`."""
    return conv1d.causal_conv1d_update(x, conv_states, weight, bias, activation,
                                       conv_state_indices=conv_state_indices, **speculative)


chunk_gated_delta_rule_cpu = gated_delta_rule.chunk_gated_delta_rule


def fused_gdn_gating_cpu(A_log, a, b, dt_bias, beta=1.0, threshold=20.0):
    """(g, beta) gates; see `gated_delta_rule.fused_gdn_gating`."""
    return gated_delta_rule.fused_gdn_gating(A_log, a, b, dt_bias, beta, threshold)


def fused_sigmoid_gating_delta_rule_update_cpu(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                               initial_state_indices, cu_seqlens,
                                               use_qk_l2norm_in_kernel, softplus_beta=1.0,
                                               softplus_threshold=20.0, **speculative):
    """Decode step with fused gating (and speculative verify's, with its intermediate states);
    see `gated_delta_rule.fused_sigmoid_gating_delta_rule_update`."""
    return gated_delta_rule.fused_sigmoid_gating_delta_rule_update(
        A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=softplus_beta,
        softplus_threshold=softplus_threshold, q=q, k=k, v=v, b=b,
        initial_state_source=initial_state_source, initial_state_indices=initial_state_indices,
        cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **speculative)
