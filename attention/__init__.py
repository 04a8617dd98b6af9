"""Kernels-facing MLA prefill code: backends, merge_attn_states, RoPE and the MLA layer. No Ray here."""
