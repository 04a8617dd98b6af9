"""Build the MoE, FP8, activation and MLA Triton kernels (``workers/moe_triton.py``, ``workers/fp8_triton.py``,
``workers/activation_triton.py``, ``attention/mla_triton.py``, ``attention/rms_norm_triton.py``) for SM90 (H100/H200) without a GPU
and print each one's resources as JSON: ``python tests/triton_sm90.py`` (run without
``TRITON_INTERPRET``, which would hand Triton's compiler interpreted functions). Used by
``tests/unit/test_triton_sm90.py``."""

import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from configs.model import builtin_models, load_model_config
from attention import mla_triton, rms_norm_triton
from workers import activation_triton, fp8_triton, moe_triton
from workers.fp8 import EPS, FP8_MAX

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
ROUTE = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64", "T": "i32", "E": "i32", "scaling": "fp32"}
GATHER_SUM = {"src_ptr": "*bf16", "index_ptr": "*i64", "add_ptr": "*bf16", "out_ptr": "*bf16", "H": "i32", "src_stride": "i32", "add_stride": "i32",
              "out_stride": "i32"}  # fmt: skip
QUANTIZE = {"x_ptr": "*bf16", "w_ptr": "*fp32", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "dest_ptr": "*i64",
            "M": "i32", "M_PAD": "i32", "K": "i32", "x_stride": "i32", "q_stride": "i32", "s_stride_g": "i32"}  # fmt: skip
KEYS = {"kv_ptr": "*bf16", "pe_ptr": "*bf16", "k_ptr": "*bf16", "T": "i32", "H": "i32", "kv_stride_t": "i32", "kv_stride_h": "i32", "pe_stride_t": "i32"}
RMS_NORM = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "res_ptr": "*bf16", "M": "i32", "D": "i32", "x_stride": "i32", "out_stride": "i32",
            "res_stride": "i32", "eps": "fp32"}  # fmt: skip
RESIDUAL_NORMS = {  # the decoder's float32 residual stream (workers.model): its first norm, and each add with its norm
    "float32-rows": ({**RMS_NORM, "x_ptr": "*fp32"}, False),
    "add": ({**RMS_NORM, "res_ptr": "*fp32"}, True),
}
RMS_NORM_FP8 = {"x_ptr": "*bf16", "w_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "res_ptr": "*fp32", "M": "i32", "M_PAD": "i32", "D": "i32",
                "x_stride": "i32", "q_stride": "i32", "s_stride": "i32", "res_stride": "i32", "eps": "fp32"}  # fmt: skip
FP8_NORMS = {  # workers.fp8.FP8RMSNorm: a layer's first norm on the float32 stream, each add with its norm, q_a_layernorm's bf16 rows
    "float32-rows": ({**RMS_NORM_FP8, "x_ptr": "*fp32"}, False),
    "add": (RMS_NORM_FP8, True),
    "bf16-rows": (RMS_NORM_FP8, False),
}
SILU_MUL = {"x_ptr": "*bf16", "w_ptr": "*fp32", "out_ptr": "*bf16", "M": "i32", "K": "i32", "x_stride": "i32", "out_stride": "i32"}
ROTATE = {"x_ptr": "*bf16", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "T": "i32", "H": "i32", "stride_t": "i32", "stride_h": "i32"}
QUANTIZE_CASES = {  # group, silu_mul, row_weight, scatter: as fp8.py and moe.py call it
    "linear-1x128": (128, False, False, 0),
    "dense-activation-1x128": (128, True, False, 0),  # an FP8 down_proj's input: silu(g) * u of the dense MLP
    "experts-input": (7168, False, False, 0),
    "experts-input-scattered": (7168, False, False, 8),
    "experts-activation": (2048, True, True, 0),
    "two-passes": (2 * fp8_triton.ONE_PASS_WIDTH, False, False, 0),  # a group too wide for one pass
}


def cases() -> dict:
    """name -> (kernel, argument types, compile-time arguments and launch options), with the launchers' own choices."""
    out = {}
    for name in builtin_models():
        moe = load_model_config(name).moe
        if moe is not None:
            out[f"route-{name}"] = (moe_triton._route_kernel, ROUTE, moe_triton.route_constants(moe, moe.n_routed_experts, biased=True))
    for heads, name in ((128, "queries-128-heads"), (16, "queries-16-heads"), (1, "latent")):  # TP 1 and 8, the key
        out[f"rope-{name}"] = (mla_triton._rotate_kernel, ROTATE, mla_triton.rotate_constants(64, heads, interleaved=True))
    for nope, rope, heads in ((128, 64, 128), (128, 64, 16), (16, 8, 4)):  # TP 1 and 8; the tests' tiny models
        out[f"keys-{nope}+{rope}-{heads}-heads"] = (mla_triton._keys_kernel, KEYS, mla_triton.keys_constants(nope, rope, heads))
    for width in (7168, 5120, 2048, 1536, 512):  # hidden sizes (V3, V2, V2-Lite), q and kv LoRA ranks
        out[f"rms-norm-{width}"] = (rms_norm_triton._rms_norm_kernel, RMS_NORM, {**rms_norm_triton.rms_norm_constants(width), "ADD": False})
    for width in (7168, 5120, 2048):  # the hidden sizes again, on the residual stream
        for kind, (types, add) in RESIDUAL_NORMS.items():
            out[f"rms-norm-{width}-{kind}"] = (rms_norm_triton._rms_norm_kernel, types, {**rms_norm_triton.rms_norm_constants(width), "ADD": add})
    for width in (7168, 5120, 2048, 1536):  # the hidden sizes and V3's q LoRA rank, norms written as FP8 rows for FP8 linears
        for kind, (types, add) in FP8_NORMS.items():
            constants = {**rms_norm_triton.rms_norm_constants(width, per_thread=rms_norm_triton.FP8_PER_THREAD), "ADD": add, "GROUP": 128,
                         "FP8_MAX": FP8_MAX, "Q_EPS": EPS}  # fmt: skip
            out[f"rms-norm-fp8-{width}-{kind}"] = (rms_norm_triton._rms_norm_fp8_kernel, types, constants)
    for weighted in (False, True):  # a dense MLP's activation, the experts' (times each pair's weight)
        out[f"silu-mul{'-weighted' if weighted else ''}"] = (activation_triton._silu_mul_kernel, SILU_MUL, activation_triton.silu_mul_constants(weighted))
    for add in (False, True):  # the routed sum, and with the shared experts' rows added in its pass
        out[f"gather-sum{'-add' if add else ''}"] = (moe_triton._gather_sum_kernel, GATHER_SUM, {"SLOTS": 8, "BLOCK": moe_triton.BLOCK_H, "ADD": add})
    for name, (group, silu_mul, row_weight, scatter) in QUANTIZE_CASES.items():
        constants = fp8_triton.quantize_constants(group, FP8_MAX, EPS, silu_mul=silu_mul, row_weight=row_weight, scatter=scatter)
        out[f"quantize-{name}"] = (fp8_triton._quantize_kernel, QUANTIZE, constants)
    return out


def resources(kernel, types: dict, constants: dict) -> dict:
    """Registers, stack and local memory of ``kernel`` built for SM90 (Triton's ptxas, its cuobjdump)."""
    constants = dict(constants)
    options = {"num_warps": constants.pop("num_warps")} if "num_warps" in constants else {}
    signature = {**types, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True)
    line = next(line for line in usage.stdout.splitlines() if "REG:" in line)
    return {key: int(value) for key, value in re.findall(r"(REG|STACK|LOCAL):(\d+)", line)}


def main() -> None:
    report = {}
    for name, (kernel, types, constants) in cases().items():
        try:
            report[name] = resources(kernel, types, constants)
        except Exception as exc:  # noqa: BLE001 -- each kernel's failure is reported by its own test
            report[name] = {"error": f"{type(exc).__name__}: {exc}"[-2000:]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
