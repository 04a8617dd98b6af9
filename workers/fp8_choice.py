"""How a worker runs an FP8 checkpoint, decided at its start (``PrefillWorker.setup``): FP8 GEMMs or
weights dequantized at load (:func:`use_fp8`), and what runs the FP8 GEMMs (:func:`fp8_gemm_for`:
``PoolConfig.fp8_gemm`` resolved). Rank 0 says both in its log, with the reasons."""

from __future__ import annotations

import logging

import torch

from configs.model import ModelConfig
from configs.pool import PoolConfig
from workers import deepgemm
from workers.fp8 import fp8_gemm_supported

logger = logging.getLogger(__name__)


def use_fp8(config: PoolConfig, model_config: ModelConfig, device: torch.device, dtype: torch.dtype, *, announce: bool) -> bool:
    """FP8 GEMMs for an FP8 model (``quantization="auto"``) where torch runs DeepSeek's block-scaled
    recipe (SM90) and the compute dtype is bfloat16; otherwise its weights are dequantized at load
    (logged with every reason when ``announce``)."""
    if model_config.quantization is None:
        return False
    reasons = []
    if config.quantization == "none":
        reasons.append("quantization='none'")
    if not fp8_gemm_supported(device):
        reasons.append(f"{device} is not an SM90 GPU (torch's block-scaled FP8 GEMM)")
    if dtype != torch.bfloat16:
        reasons.append(f"the compute dtype is {str(dtype).removeprefix('torch.')}, not bfloat16")
    if reasons and announce:
        logger.warning("%s: FP8 weights are dequantized to %s at load: %s", model_config.name, dtype, "; ".join(reasons))
    return not reasons


def fp8_gemm_for(config: PoolConfig, model_config: ModelConfig, fp8: bool, *, announce: bool) -> str | None:
    """What runs the FP8 GEMMs (``config.fp8_gemm`` resolved; None: no FP8 GEMMs here, the weights
    dequantized), logged when ``announce``. "auto" takes DeepGEMM where it imports and the routed
    experts (if any) are whole 128x128 blocks, torch's GEMMs otherwise; "deep_gemm" imports DeepGEMM
    here, so that a worker without it fails to start, naming it."""
    choice = config.fp8_gemm
    if not fp8:
        if choice == "deep_gemm" and model_config.quantization is not None and announce:
            logger.warning("%s: fp8_gemm 'deep_gemm' has no effect: the FP8 weights are dequantized here", model_config.name)
        return None
    why = ""
    if choice == "auto":
        choice, why = _auto(model_config)
    elif choice == "deep_gemm":
        deepgemm.load()
    if announce:
        logger.info("%s: FP8 GEMMs run by %s%s", model_config.name, choice, why)
    return choice


def _auto(model_config: ModelConfig) -> tuple[str, str]:
    """fp8_gemm "auto" resolved, and why: DeepGEMM where it imports and takes the experts' shape."""
    try:
        deepgemm.load()
    except RuntimeError as exc:
        return "torch", f" (auto: DeepGEMM is not here: {exc.__cause__})"
    moe = model_config.moe
    if moe is not None and not deepgemm.whole_blocks(model_config.hidden_size, moe.moe_intermediate_size):
        return "torch", " (auto: DeepGEMM needs the experts' hidden and width in whole 128-wide blocks)"
    return "deep_gemm", " (auto: DeepGEMM is here)"
