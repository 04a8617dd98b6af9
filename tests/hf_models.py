"""Tiny random transformers DeepseekV3 models: the independent implementation the parity tests compare with."""

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


def tiny_deepseek_v3(*, vocab_size=300, num_layers=3, max_positions=256, mscale_all_dim=0.8, seed=1):
    """An all-dense DeepseekV3ForCausalLM (q LoRA, YaRN) with weights ~ N(0, 0.1), in eval mode."""
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, first_k_dense_replace=num_layers,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": max_positions // 4, "mscale": 1.0,
                         "mscale_all_dim": mscale_all_dim},
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
    return model
