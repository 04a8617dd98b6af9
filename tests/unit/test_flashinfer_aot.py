"""deploy/flashinfer_aot.py: built modules land where FlashInfer loads them without compiling, travel
in parts that come back whole or not at all, and what a user can get wrong is named. (Building needs nvcc and minutes to hours: done by hand, see the
script's docstring; what it built was loaded by vLLM on an H200, docs/performance.md.)"""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "deploy"))
from flashinfer_aot import MODULES, install, main, unpack  # noqa: E402


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


def test_pack_splits_modules_into_one_folder_per_part_and_unpack_gives_them_back_whole(tmp_path, capsys):
    built = tmp_path / "built"
    moe = os.urandom(5 << 19)  # 2.5 MiB that gzip cannot shrink: three parts of 1 MiB
    _module(built, "fused_moe_90", moe)
    _module(built, "fp8_blockscale_gemm_90", b"gemm" * 1000)
    stage = tmp_path / "stage"
    (stage / "fi-aot-07").mkdir(parents=True)  # left by an earlier pack: not joined with these
    main(["pack", "--modules-dir", str(built), "--out", str(stage), "--max-part-mb", "1"])
    assert sorted(p.name for p in stage.iterdir()) == ["fi-aot-00", "fi-aot-01", "fi-aot-02"]
    assert all(p.stat().st_size <= 1 << 20 for p in stage.glob("fi-aot-*/fi-aot.tar.gz.part*"))
    node = tmp_path / "node"  # where a copy lands: each folder copied on its own
    for folder in stage.iterdir():
        shutil.copytree(folder, node / folder.name)
    main(["unpack", "--parts-dir", str(node), "--out", str(node / "fi-aot")])
    assert (node / "fi-aot" / "fused_moe_90" / "fused_moe_90.so").read_bytes() == moe
    assert (node / "fi-aot" / "fp8_blockscale_gemm_90" / "fp8_blockscale_gemm_90.so").read_bytes() == b"gemm" * 1000
    assert "3 part(s) of <= 1 MiB" in capsys.readouterr().out


def test_unpack_refuses_a_missing_or_damaged_part_and_no_manifest(tmp_path):
    built = tmp_path / "built"
    _module(built, "fused_moe_90", os.urandom(3 << 19))
    stage = tmp_path / "stage"
    main(["pack", "--modules-dir", str(built), "--out", str(stage), "--max-part-mb", "1"])
    shutil.rmtree(stage / "fi-aot-01")
    with pytest.raises(SystemExit, match=r"1 of 2 parts found \(fi-aot.tar.gz.part00\): copy every fi-aot-NN folder"):
        unpack(stage, tmp_path / "out")
    main(["pack", "--modules-dir", str(built), "--out", str(stage), "--max-part-mb", "1"])
    part = stage / "fi-aot-01" / "fi-aot.tar.gz.part01"
    damaged = bytearray(part.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    part.write_bytes(bytes(damaged))
    with pytest.raises(SystemExit, match=r"do not match pack's digest"):
        unpack(stage, tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing extracted from a damaged archive
    with pytest.raises(SystemExit, match=r"no fi-aot-00/fi-aot.json"):
        unpack(tmp_path / "elsewhere", tmp_path / "out")
