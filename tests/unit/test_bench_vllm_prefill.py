"""``benchmarks/bench_vllm_prefill.py``'s reading of its runs (the GPU run against vLLM's MoE backends
is only as right as these): the cases and prompts every side gets, the MoE layer's FLOPs, the backend
vLLM's log names, the ratios and the MoE table, bench_moe.py's run folded in, the arguments it
refuses, the GPU's clock and power read after each side's runs; and
``benchmarks/profile_prefill.kernel_shares``, the parts of a profiled prefill."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
from bench_vllm_prefill import backend_in_log, moe_layer_flops, moe_layer_table, parse_case, prompts, ratios, workers_sides  # noqa: E402
from machine import parse_query  # noqa: E402
from profile_prefill import idle_gaps, kernel_shares  # noqa: E402

V3 = {"hidden_size": 7168, "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1}


def test_a_case_is_prompts_times_tokens_and_anything_else_is_refused_naming_the_form():
    assert parse_case("16x4096") == (16, 4096)
    assert parse_case("1X32768") == (1, 32768)
    for bad in ("16", "x4096", "0x10", "4x-1", "16*4096"):
        with pytest.raises(Exception, match="expected NxL"):
            parse_case(bad)


def test_every_side_gets_the_same_prompts_and_every_repeat_new_ones():
    first = prompts("4x64", 0, vocab=1000, seed=0)
    assert first == prompts("4x64", 0, vocab=1000, seed=0)
    assert len(first) == 4 and all(len(p) == 64 and all(0 <= t < 1000 for t in p) for p in first)
    assert first != prompts("4x64", 1, vocab=1000, seed=0) != prompts("4x64", -1, vocab=1000, seed=0)
    assert len({tuple(p) for p in first}) == 4  # no two prompts of a case alike: no prefix shared between them


def test_the_moe_layer_counts_the_router_the_k_routed_and_the_shared_experts():
    tokens = 32768
    router = 2 * tokens * 7168 * 256
    expert = 2 * tokens * 3 * 7168 * 2048  # gate, up and down
    assert moe_layer_flops(V3, tokens) == router + 9 * expert
    assert moe_layer_flops({**V3, "n_shared_experts": 0}, tokens) == router + 8 * expert


def test_the_backend_and_triton_config_are_what_vllms_log_says():
    log = """INFO [fp8.py:325] Using TRITON Fp8 MoE backend out of potential backends: ['TRITON', 'AITER'].
WARNING [fused_moe.py:1107] Using default MoE config. Performance might be sub-optimal! Config file not found at /x.json"""
    assert backend_in_log(log) == {"moe_backend": "TRITON", "moe_config": "default"}
    tuned = "INFO Using DEEPGEMM Fp8 MoE backend out of x\nINFO [fused_moe.py:1094] Using configuration from /t/E=256.json for MoE layer."
    assert backend_in_log(tuned) == {"moe_backend": "DEEPGEMM", "moe_config": "/t/E=256.json"}
    assert backend_in_log("no MoE here") == {"moe_backend": None, "moe_config": None}


def _side(seconds: dict, layer_s: float | None = None) -> dict:
    side = {"cases": {case: {"seconds_p50": s, "layer_tokens_per_s": 1000 / s} for case, s in seconds.items()}}
    if layer_s is not None:
        side["moe_layer"] = {"tokens": 32768, "layer_s": layer_s}
    return side


def test_the_pool_is_set_against_each_vllm_side_and_the_fastest_per_case():
    sides = {
        "pool": _side({"16x4096": 0.55, "1x32768": 0.54}),
        "workers": _side({"16x4096": 0.535}, layer_s=0.032),
        "vllm:triton": _side({"16x4096": 0.60, "1x32768": 0.57}, layer_s=0.045),
        "vllm:deep_gemm": _side({"16x4096": 0.53, "1x32768": 0.58}, layer_s=0.029),
        "vllm:flashinfer_cutlass": {"error": "stopped after 480 s"},
    }
    out = ratios(sides, ["16x4096", "1x32768", "2x8"])
    assert out["16x4096"]["vllm_best"] == "vllm:deep_gemm"
    assert out["16x4096"]["pool_over_vllm_best"] == pytest.approx(0.53 / 0.55)
    assert out["1x32768"]["vllm_best"] == "vllm:triton"  # the fastest per case, not one backend for all
    assert out["1x32768"]["pool_over"] == {"vllm:triton": pytest.approx(0.57 / 0.54), "vllm:deep_gemm": pytest.approx(0.58 / 0.54)}
    assert "2x8" not in out  # a case no side ran
    assert out["16x4096"]["pool_best"] == "pool" and out["16x4096"]["pools_over_vllm_best"] == {"pool": pytest.approx(0.53 / 0.55)}
    two = ratios({**sides, "pool:deep_gemm": _side({"16x4096": 0.50})}, ["16x4096", "1x32768"])
    assert two["16x4096"]["pool_best"] == "pool:deep_gemm"  # the fastest pool side sets the ratios
    assert two["16x4096"]["pool_over_vllm_best"] == pytest.approx(0.53 / 0.50)
    assert two["16x4096"]["pools_over_vllm_best"] == {"pool": pytest.approx(0.53 / 0.55), "pool:deep_gemm": pytest.approx(0.53 / 0.50)}
    assert two["1x32768"]["pool_best"] == "pool"  # a side without the case is left out of it
    assert ratios({"vllm:triton": sides["vllm:triton"]}, ["16x4096"]) == {}  # no pool, no ratio

    table = moe_layer_table(V3, sides, 32768)
    assert set(table["sides"]) == {"workers", "vllm:triton", "vllm:deep_gemm"}
    deep = table["sides"]["vllm:deep_gemm"]
    assert deep["tflops"] == pytest.approx(moe_layer_flops(V3, 32768) / 0.029 / 1e12)
    assert deep["fraction_of_peak"] == pytest.approx(deep["tflops"] / 1979.0)
    assert moe_layer_table(V3, sides, 65536)["sides"] == {}  # timed at another token count: not comparable


def test_bench_moes_one_gpu_run_is_folded_in_with_its_moe_layer_or_its_error():
    run = {"layout": "fp8-1gpu", "gpus": 1, "moe_layer": [{"tokens_per_gpu": 32768, "layer_s": 0.0318}],
           "cases": [{"case": "16x4096", "seconds": 0.5347, "layer_tokens_per_s_per_gpu": 612877.0},
                     {"case": "1x8192", "seconds": 0.08, "layer_tokens_per_s_per_gpu": 5e5}]}  # fmt: skip
    two = {**run, "layout": "fp8-2gpu", "gpus": 2}
    deep = {**run, "layout": "fp8-1gpu-deep_gemm", "fp8_gemm": "deep_gemm", "moe_layer": [{"tokens_per_gpu": 32768, "layer_s": 0.029}]}
    sides = workers_sides({"runs": [two, run, deep]}, Path("w.json"), ["16x4096", "1x32768"])
    assert sides["workers"] == {"source": "w.json", "layout": "fp8-1gpu", "cases": {"16x4096": {"seconds_p50": 0.5347, "layer_tokens_per_s": 612877.0}},
                                "moe_layer": {"tokens": 32768, "layer_s": 0.0318}}  # fmt: skip
    assert sides["workers:deep_gemm"]["layout"] == "fp8-1gpu-deep_gemm" and sides["workers:deep_gemm"]["moe_layer"]["layer_s"] == 0.029
    assert set(sides) == {"workers", "workers:deep_gemm"}  # the two-GPU run is not a side
    error = {"layout": "fp8-1gpu", "error": "x" * 500 + "CUDA out of memory"}
    failed = workers_sides({"runs": [deep], "errors": [error]}, Path("w.json"), ["16x4096"])["workers"]
    assert failed["error"][0].endswith("CUDA out of memory") and "cases" not in failed
    assert set(workers_sides({"runs": [deep], "errors": []}, Path("w.json"), ["16x4096"])) == {"workers:deep_gemm"}  # no torch run asked for


@pytest.mark.parametrize(
    "backends, message",
    [(["triton-tuned", "triton"], "triton-tuned needs triton before it"), (["deep-gemm"], "expected one of auto, triton, deep_gemm")],
)
def test_backends_it_cannot_run_are_refused_before_anything_starts(tmp_path, backends, message):
    (tmp_path / "ckpt").mkdir()
    config = {**V3, "num_hidden_layers": 5, "vocab_size": 1000, "quantization_config": {"weight_block_size": [128, 128]}}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    command = [sys.executable, str(BENCHMARKS / "bench_vllm_prefill.py"), "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "o.json")]
    done = subprocess.run([*command, "--backends", *backends], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({**config, "quantization_config": {}}))  # bf16: nothing to tune
    done = subprocess.run([*command, "--backends", "triton", "triton-tuned"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "is not in a block-FP8 format" in done.stderr, done.stderr
    assert not (tmp_path / "o.json").exists()


def test_the_gpus_clock_and_power_are_read_from_nvidia_smis_line_or_not_at_all():
    assert parse_query("1350, 678.86\n") == [1350.0, 678.86]  # --format=csv,noheader,nounits
    assert parse_query("700.00, 1980\n1500, 650.5\n") == [700.0, 1980.0]  # the first GPU's line
    for unsaid in ("[N/A], 600.1", "1350, [Not Supported]", "", "\n"):
        assert parse_query(unsaid) is None


def test_a_profiles_kernels_fall_into_the_parts_of_the_model_by_name():
    kernels = [
        ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", 245.0),  # FP8 block-scaled linear
        ("_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS1_17GroupProblemShapeIN4cute5tupleIJiiiEEEEE", 105.0),  # experts
        ("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at__tensor", 93.0),  # FA4
        # DeepGEMM: dense (1 group) and the experts' grouped GEMM (256 groups), told apart by that template value only
        ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 36864u, 7168u, 1u, 256u, 128u, 128u, 128u", 75.0),
        ("void deep_gemm::sm90_fp8_gemm_1d2d_impl<(cute::UMMA::Major)0, 0u, 4096u, 7168u, 256u, 128u, 192u, 128u, 128u", 48.0),
        ("_quantize_kernel", 21.0), ("_rms_norm_kernel", 13.6), ("_rms_norm_fp8_kernel", 4.0), ("_keys_kernel", 7.5), ("_rotate_kernel", 3.2),
        ("_gather_sum_kernel", 3.9), ("_route_kernel", 1.0), ("void at_cuda_detail::cub::detail::radix_sort::DeviceRadixSortOnesweepKernel", 0.2),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>", 1.3), ("Memcpy DtoH (Device -> Pageable)", 3.1),
    ]  # fmt: skip
    shares = kernel_shares(kernels)
    assert {part: entry["ms"] for part, entry in shares.items()} == {
        "moe_experts": 153.0, "attention": 93.0, "linears": 320.0, "fp8_quantize": 21.0, "moe_routing": 5.1, "norms": 17.6,
        "rope_and_keys": 10.7, "glue": 4.4}  # fmt: skip
    assert sum(entry["share"] for entry in shares.values()) == pytest.approx(1.0, abs=1e-3)
    assert kernel_shares([])["glue"] == {"ms": 0.0, "share": 0.0}


def test_a_profiles_idle_gaps_are_found_between_kernels_with_their_neighbours():
    def kernel(name, start_us, end_us):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start_us, end=end_us))

    events = [kernel("gemm", 0, 1000), kernel("copy", 500, 1200),  # overlapping: no gap
              kernel("norm", 1300, 1400),  # 0.1 ms after the copy
              kernel("DtoH", 1400, 1450), kernel("attention", 3450, 9000),  # 2 ms: a host sync
              kernel("tiny", 9010, 9020)]  # fmt: skip
    got = idle_gaps(events, top=5)
    assert got["idle_ms"] == pytest.approx(2.11)
    assert got["gaps"] == [{"ms": 2.0, "at_ms": 1.45, "after": "DtoH", "before": "attention"},
                           {"ms": 0.1, "at_ms": 1.2, "after": "copy", "before": "norm"}]  # fmt: skip
    assert idle_gaps([]) == {"idle_ms": 0.0, "gaps": []}
