"""Chunked prefill at DeepSeek-V3's shapes on the GPU: no token may be worse than in one chunk.

One MLA layer of DeepSeek-V3 (128 heads, qk 192 / v 128, latent 576; random weights) prefills a
16K-token prompt in bf16 twice with each GPU backend -- in one chunk, and in 4K-token chunks
whose later chunks attend to the cached latent rows in 8K-row pieces (so a chunk merges up to
three partial results) -- and both are compared with float32 attention of the same layer in one
chunk. The comparison is per token (the attention output of all heads before ``o_proj``), so a
few bad tokens fail it even when the mean error is at the bf16 level: that is how merging
FlashInfer's ``[T, H]`` LSE in place went wrong (``attention.merge_triton``).
"""

import pytest
import torch

from attention.backends.base import DEEPSEEK_MLA_DIMS, DeviceCapability, MLAPrefillSelectorConfig
from attention.backends.registry import MLAPrefillBackendEnum
from attention.backends.selector import backend_reasons
from attention.backends.torch_sdpa import TorchSDPAPrefillBackend
from attention.mla import MLAAttention, plan_prefill_batch
from configs.model import load_model_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
TOKENS, CHUNK, WORKSPACE = 16384, 4096, 8192


def _gpu_backends() -> list:
    """Every backend that can serve DeepSeek's dims in bf16 on this GPU (none without one)."""
    if not torch.cuda.is_available():
        return []
    cap = DeviceCapability.of("cuda")
    selector = MLAPrefillSelectorConfig(torch.bfloat16, DEEPSEEK_MLA_DIMS)
    return [
        member
        for member in MLAPrefillBackendEnum
        if member is not MLAPrefillBackendEnum.CUSTOM and not backend_reasons(member, cap, selector)[1]
    ]


def _attention_outputs(layer: MLAAttention, hidden: torch.Tensor, chunk: int) -> torch.Tensor:
    """The merged attention output ``[T, heads * v]`` (the input of ``o_proj``), ``chunk`` tokens at a time."""
    seen, latents = [], []
    hook = layer.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0].float()))
    try:
        for start in range(0, hidden.shape[0], chunk):
            piece = hidden[start : start + chunk]
            batch = plan_prefill_batch(
                [piece.shape[0]], [start], workspace_tokens=WORKSPACE, device=hidden.device, backend=layer.backend
            )
            _, latent = layer(piece, batch, torch.cat(latents) if latents else None)
            latents.append(latent)
    finally:
        hook.remove()
    return torch.cat(seen)


def _token_errors(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return (got - ref).abs().amax(dim=1) / ref.abs().max()


@pytest.mark.parametrize("member", _gpu_backends(), ids=lambda member: member.name)
@torch.no_grad()
def test_chunked_prefill_has_no_outlier_tokens(member):
    config = load_model_config("deepseek-v3").attention
    torch.manual_seed(0)
    reference = MLAAttention(config, config.create_backend(TorchSDPAPrefillBackend, device="cuda"), device="cuda")
    hidden = torch.randn(TOKENS, config.hidden_size, device="cuda")
    expected = _attention_outputs(reference, hidden, TOKENS)
    layer = MLAAttention(config, config.create_backend(member.get_class(), device="cuda"), dtype=torch.bfloat16, device="cuda")
    layer.load_state_dict(reference.state_dict())
    one_chunk = _token_errors(_attention_outputs(layer, hidden.bfloat16(), TOKENS), expected)
    chunked = _token_errors(_attention_outputs(layer, hidden.bfloat16(), CHUNK), expected)
    worst = chunked.argmax().item()
    # chunking adds merges in float32 and one more bf16 rounding, never a token twice as wrong
    assert chunked.max() <= 2 * one_chunk.max(), (
        f"{member.name}: token {worst} (chunk {worst // CHUNK}, offset {worst % CHUNK}) is off by "
        f"{chunked.max():.4f} of the largest output; one chunk's worst token: {one_chunk.max():.4f}"
    )
