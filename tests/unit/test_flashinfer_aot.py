"""deploy/flashinfer_aot.py: built modules land where FlashInfer loads them without compiling, and
what a user can get wrong is named. (Building needs nvcc and minutes to hours: done by hand, see the
script's docstring; what it built was loaded by vLLM on an H200, docs/performance.md.)"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))
from flashinfer_aot import MODULES, install, main  # noqa: E402


def _site(tmp_path):
    site = tmp_path / "site"
    (site / "flashinfer").mkdir(parents=True)
    return site


def _module(folder, name, payload=b"\x7fELF"):
    so = folder / name / f"{name}.so"
    so.parent.mkdir(parents=True, exist_ok=True)
    so.write_bytes(payload)
    return so


def test_install_puts_each_module_in_flashinfers_aot_folder(tmp_path):
    built = tmp_path / "built"
    _module(built, "fp8_blockscale_gemm_90", b"gemm")
    _module(built, "fused_moe_90", b"moe")
    site = _site(tmp_path)
    main(["install", "--modules-dir", str(built), "--site", str(site)])
    aot = site / "flashinfer" / "data" / "aot"
    assert (aot / "fp8_blockscale_gemm_90" / "fp8_blockscale_gemm_90.so").read_bytes() == b"gemm"
    assert (aot / "fused_moe_90" / "fused_moe_90.so").read_bytes() == b"moe"


def test_install_refuses_an_unknown_module_an_empty_folder_and_a_site_without_flashinfer(tmp_path):
    built = tmp_path / "built"
    _module(built, "fused_moe_100")
    site = _site(tmp_path)
    with pytest.raises(SystemExit, match=r"unknown module\(s\) \['fused_moe_100'\]; valid: fp8_blockscale_gemm_90, fused_moe_90"):
        install(built, site)
    assert not (site / "flashinfer" / "data").exists()  # nothing placed
    with pytest.raises(SystemExit, match=r"no <name>/<name>.so inside"):
        install(tmp_path / "empty", site)
    with pytest.raises(SystemExit, match=r"no flashinfer package there"):
        install(built, tmp_path / "elsewhere")


def test_build_names_unknown_modules_and_a_bad_job_count(tmp_path, capsys):
    with pytest.raises(SystemExit, match=r"unknown module\(s\) \['gemm'\]; valid: " + ", ".join(MODULES)):
        main(["build", "--flashinfer-path", str(tmp_path), "--modules", "gemm", "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        main(["build", "--flashinfer-path", str(tmp_path), "--modules", "fused_moe_90", "--out", str(tmp_path / "o"), "--jobs", "0"])
    assert "--jobs 0: must be at least 1" in capsys.readouterr().err
