"""Backend registry (enum, overrides, CUSTOM) and selector (explicit, priorities, reasons)."""

import logging
from dataclasses import replace

import pytest
import torch

from attention.backends import selector
from attention.backends.base import DEEPSEEK_MLA_DIMS, DeviceCapability, MLAPrefillSelectorConfig
from attention.backends.registry import MLAPrefillBackendEnum, register_mla_prefill_backend
from attention.backends.selector import ENV_BACKEND, backend_priorities, get_mla_prefill_backend
from attention.backends.torch_sdpa import TorchSDPAPrefillBackend

B = MLAPrefillBackendEnum
CPU = DeviceCapability("cpu")
HOPPER = DeviceCapability("cuda", 9, 0)
BF16 = MLAPrefillSelectorConfig(torch.bfloat16, DEEPSEEK_MLA_DIMS)


@pytest.fixture(autouse=True)
def _clean_registry(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    yield
    for member in B:
        member.clear_override()


def test_every_member_named_in_the_design_exists():
    assert [m.name for m in B] == [
        "FLASH_ATTN", "FLASHINFER", "TRTLLM_RAGGED", "TOKENSPEED_MLA", "AITER_FLASH_ATTN", "TORCH_SDPA", "CUSTOM",
    ]  # fmt: skip


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match=r"unknown MLA prefill backend 'FLASH'; valid: FLASH_ATTN, FLASHINFER, .*CUSTOM"):
        B["FLASH"]
    assert B.parse(" flashinfer ") is B.FLASHINFER
    with pytest.raises(TypeError, match="MLAPrefillBackendEnum or its name"):
        B.parse(3)


def test_custom_before_registration_raises():
    with pytest.raises(ValueError, match="CUSTOM has no class: register one"):
        B.CUSTOM.get_class()
    with pytest.raises(ValueError, match="CUSTOM has no class"):
        get_mla_prefill_backend(BF16, CPU, backend="custom")


def test_custom_by_decorator_and_clear():
    @register_mla_prefill_backend(B.CUSTOM)
    class MyBackend(TorchSDPAPrefillBackend):
        name = "MY_BACKEND"

    assert B.CUSTOM.get_class() is MyBackend
    assert B.CUSTOM.is_overridden()
    assert get_mla_prefill_backend(BF16, CPU, backend="CUSTOM") is MyBackend
    B.CUSTOM.clear_override()
    assert not B.CUSTOM.is_overridden()
    with pytest.raises(ValueError, match="CUSTOM has no class"):
        B.CUSTOM.get_class()


def test_custom_by_class_path_and_clear():
    register_mla_prefill_backend("CUSTOM", "attention.backends.torch_sdpa.TorchSDPAPrefillBackend")
    assert B.CUSTOM.get_path() == "attention.backends.torch_sdpa.TorchSDPAPrefillBackend"
    assert B.CUSTOM.get_class() is TorchSDPAPrefillBackend
    B.CUSTOM.clear_override()
    with pytest.raises(ValueError):
        B.CUSTOM.get_path()


def test_override_of_a_builtin_changes_auto_selection_until_cleared():
    assert get_mla_prefill_backend(BF16, CPU) is TorchSDPAPrefillBackend

    @register_mla_prefill_backend(B.TORCH_SDPA)
    class Patched(TorchSDPAPrefillBackend):
        pass

    assert get_mla_prefill_backend(BF16, CPU) is Patched  # the selector cache sees overrides
    B.TORCH_SDPA.clear_override()
    assert get_mla_prefill_backend(BF16, CPU) is TorchSDPAPrefillBackend


def test_bad_registrations():
    with pytest.raises(TypeError, match="not a subclass of MLAPrefillBackend"):
        register_mla_prefill_backend(B.CUSTOM)(dict)
    with pytest.raises(ValueError, match="package.module.ClassName"):
        register_mla_prefill_backend(B.CUSTOM, "NoModule")
    register_mla_prefill_backend(B.CUSTOM, "attention.backends.torch_sdpa.NoSuchClass")
    with pytest.raises(ImportError, match="has no class 'NoSuchClass'"):
        B.CUSTOM.get_class()
    with pytest.raises(ValueError, match=r"CUSTOM cannot run.*cannot import"):
        get_mla_prefill_backend(BF16, CPU, backend=B.CUSTOM)
    register_mla_prefill_backend(B.CUSTOM, "attention.merge.merge_attn_states")
    with pytest.raises(TypeError, match="not a subclass"):
        B.CUSTOM.get_class()


def test_explicit_flashinfer_on_cpu_gives_every_reason():
    with pytest.raises(ValueError) as err:
        get_mla_prefill_backend(BF16, CPU, backend="FLASHINFER")
    message = str(err.value)
    assert message.startswith("MLA prefill backend FLASHINFER cannot run on cpu")
    assert "runs on cuda devices, not on cpu" in message


def test_a_kernel_library_is_imported_only_for_a_backend_that_otherwise_fits():
    @register_mla_prefill_backend(B.FLASHINFER)
    class Unimportable(TorchSDPAPrefillBackend):
        capabilities = replace(
            TorchSDPAPrefillBackend.capabilities, device_kinds=("cuda",), dtypes=(torch.bfloat16,), requires=("no_such_lib_2",)
        )

    fp32 = MLAPrefillSelectorConfig(torch.float32, DEEPSEEK_MLA_DIMS)
    _, reasons = selector.backend_reasons(B.FLASHINFER, HOPPER, fp32)
    assert reasons == ["dtype float32 not supported (supported: bfloat16)"]  # rejected without importing
    _, reasons = selector.backend_reasons(B.FLASHINFER, HOPPER, BF16)
    assert reasons == ["module 'no_such_lib_2' cannot be imported (ModuleNotFoundError: No module named 'no_such_lib_2')"]


def test_explicit_choice_from_environment(monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "torch_sdpa")
    assert get_mla_prefill_backend(BF16, CPU) is TorchSDPAPrefillBackend
    monkeypatch.setenv(ENV_BACKEND, "FLASH_ATTN")
    with pytest.raises(ValueError, match="FLASH_ATTN cannot run on cpu"):
        get_mla_prefill_backend(BF16, CPU)
    monkeypatch.setenv(ENV_BACKEND, "nope")
    with pytest.raises(ValueError, match="unknown MLA prefill backend 'nope'"):
        get_mla_prefill_backend(BF16, CPU)
    # an explicit argument wins over the environment
    assert get_mla_prefill_backend(BF16, CPU, backend="TORCH_SDPA") is TorchSDPAPrefillBackend


def test_priorities_per_device():
    assert backend_priorities(CPU) == (B.TORCH_SDPA,)
    assert backend_priorities(HOPPER) == (B.FLASH_ATTN, B.FLASHINFER, B.TORCH_SDPA)
    assert backend_priorities(DeviceCapability("cuda", 10, 0))[:2] == (B.FLASH_ATTN, B.TRTLLM_RAGGED)
    assert backend_priorities(DeviceCapability("cuda", 8, 0)) == (B.FLASH_ATTN, B.FLASHINFER, B.TORCH_SDPA)
    assert backend_priorities(DeviceCapability("rocm", 9, 4))[0] is B.AITER_FLASH_ATTN
    with pytest.raises(ValueError, match="device kind 'tpu'"):
        DeviceCapability("tpu")


def test_auto_selection_logs_choice_and_rejections(caplog):
    # A Hopper GPU whose kernel libraries are missing falls through to TORCH_SDPA, saying why.
    for member in (B.FLASHINFER, B.FLASH_ATTN):

        @register_mla_prefill_backend(member)
        class Missing(TorchSDPAPrefillBackend):
            capabilities = replace(TorchSDPAPrefillBackend.capabilities, requires=("no_such_kernel_lib",))

    with caplog.at_level(logging.INFO, logger="attention.backends.selector"):
        assert get_mla_prefill_backend(BF16, HOPPER) is TorchSDPAPrefillBackend
    text = caplog.text
    assert "FLASH_ATTN skipped: module 'no_such_kernel_lib' cannot be imported (ModuleNotFoundError" in text
    assert "FLASHINFER skipped: module 'no_such_kernel_lib' cannot be imported" in text
    assert "Using TORCH_SDPA MLA prefill backend on cuda 9.0" in text


def test_no_valid_backend_lists_all_reasons():
    fp8 = MLAPrefillSelectorConfig(torch.float8_e4m3fn, DEEPSEEK_MLA_DIMS)
    with pytest.raises(ValueError, match=r"no MLA prefill backend can run on cpu .*TORCH_SDPA: dtype float8_e4m3fn not supported"):
        get_mla_prefill_backend(fp8, CPU)


def test_capability_reasons_for_other_hardware():
    ampere = DeviceCapability("cuda", 8, 0)
    for member in (B.TRTLLM_RAGGED, B.TOKENSPEED_MLA):
        cls, reasons = selector.backend_reasons(member, HOPPER, BF16)
        assert any("compute capability 9.0 is outside the supported range 10.0 to 10.3" in r for r in reasons), reasons
    _, reasons = selector.backend_reasons(B.AITER_FLASH_ATTN, ampere, BF16)
    assert any("runs on rocm devices, not on cuda 8.0" in r for r in reasons)
