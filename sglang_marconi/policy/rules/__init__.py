"""The policy's rules, one module each: the eviction score and its tie-break (`score`), what keeping a
node is worth (`value`: Eq. 1 and the compressed-tree anchor), which nodes are candidates
(`candidates`), the eviction choices (`eviction/`), probation of input states,
where a prefill can keep a branch state (`branch_grid`), the host tier's demotion rule (`tier_rules`),
and the victim order under sliding-window pressure (`window_plan`)."""
