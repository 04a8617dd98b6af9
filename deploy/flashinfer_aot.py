#!/usr/bin/env python3
"""FlashInfer's JIT modules built ahead of time, for GPU nodes whose starts should not compile them.

vLLM 0.26 on Hopper loads two FlashInfer modules that FlashInfer compiles with nvcc on first use:
``fp8_blockscale_gemm_90`` (its FP8 block-scale linears: about 2 minutes on 16 cores) and
``fused_moe_90`` (the FLASHINFER_CUTLASS MoE backend: 182 sources, 160 of them of about 3 minutes of
one core each: about half an hour on 16 cores, about 4 hours on 2). FlashInfer loads a module without building it when ``<name>/<name>.so`` sits
in its AOT folder (``flashinfer/data/aot`` inside the package, where no ``flashinfer-jit-cache``
package is installed), so a module built once, on any machine with nvcc, serves every later start.

``build`` needs the FlashInfer version the node runs importable (``--flashinfer-path``: the vLLM
bundle's site, or ``pip install --target DIR --no-deps flashinfer-python==V apache-tvm-ffi==V``),
nvcc, the CUDA headers the modules include (cuBLAS, NVRTC and cuRAND beside the toolkit's: their
pip wheels' ``include`` folders copied into the toolkit's), and the driver's link stub
``lib64/stubs/libcuda.so`` (an empty shared library of that name will do); no GPU. It builds for
``sm_90a`` and keeps ``libcuda.so.1`` a needed library even when linked against an empty stub, so
that the driver's symbols resolve when the module is loaded on the GPU node. ``install`` puts
built modules into a site's FlashInfer AOT folder. A module too large to copy in one piece (the MoE
module, hundreds of MiB) travels as ``pack``'s parts, one folder each, gzip-compressed; ``unpack``
joins the parts wherever they were copied to, checks them against the digest ``pack`` wrote, and
gives back the folder of modules ``install`` takes.

    python deploy/flashinfer_aot.py build --flashinfer-path /tmp/fi-site --modules fp8_blockscale_gemm_90 --out .bundle/fi-aot
    python deploy/flashinfer_aot.py pack --modules-dir .bundle/fi-aot --out .bundle/stage --max-part-mb 55
    python deploy/flashinfer_aot.py unpack --parts-dir /tmp/stage --out /tmp/stage/fi-aot    # on the node
    python deploy/flashinfer_aot.py install --modules-dir /tmp/stage/fi-aot --site /tmp/vllm-site

A module built by FlashInfer's own JIT on a GPU node (``~/.cache/flashinfer/<version>/90a/
cached_ops/<name>/<name>.so``) can be installed the same way: copy it to ``DIR/<name>/<name>.so``.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from offline_bundle import write_parts  # deploy/offline_bundle.py: the bundles' parts, cut the same way

# module name -> (FlashInfer's generator of its JitSpec, as module:function)
MODULES = {
    "fp8_blockscale_gemm_90": "flashinfer.jit.gemm.fp8_blockscale:gen_fp8_blockscale_gemm_sm90_module",
    "fused_moe_90": "flashinfer.jit.fused_moe:gen_cutlass_fused_moe_sm90_module",
}


def check_modules(names: list[str]) -> None:
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        raise SystemExit(f"unknown module(s) {unknown}; valid: {', '.join(MODULES)}")


def cuda_home() -> Path:
    """The CUDA toolkit FlashInfer compiles with: CUDA_HOME, else /usr/local/cuda, else the folder above nvcc's
    on PATH; the one whose include/cuda.h exists (host-compiled sources need its headers on their path)."""
    nvcc = shutil.which("nvcc")
    candidates = [Path(p) for p in (os.environ.get("CUDA_HOME"), "/usr/local/cuda") if p]
    candidates += [Path(nvcc).resolve().parent.parent] if nvcc else []
    for path in candidates:
        if (path / "include" / "cuda.h").is_file() and (path / "bin" / "nvcc").is_file():
            return path
    raise SystemExit(f"no CUDA toolkit found (looked in {', '.join(map(str, candidates))}): set CUDA_HOME")


def build(names: list[str], flashinfer_path: Path, out: Path, jobs: int, workspace: Path | None) -> list[Path]:
    """Build each module in a child process that sees FlashInfer (and this machine's nvcc); copy its ``.so``
    into ``out/<name>/``."""
    check_modules(names)
    toolkit = cuda_home()
    temporary = workspace is None
    workspace = workspace or Path(tempfile.mkdtemp(prefix="fi-aot-"))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(flashinfer_path), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "FLASHINFER_CUDA_ARCH_LIST": "9.0a",  # no GPU to detect: Hopper's arch-specific target, as on the node
        "FLASHINFER_WORKSPACE_BASE": str(workspace),
        "MAX_JOBS": str(jobs),
        "CUDA_HOME": str(toolkit),
        # -lcuda against the toolkit's stub (or an empty one) is dropped by --as-needed: keep it needed
        "FLASHINFER_EXTRA_LDFLAGS": "-Wl,--no-as-needed -lcuda -Wl,--as-needed",
    }
    built = []
    for name in names:
        print(f"{name}: building in {workspace} with {jobs} nvcc jobs", flush=True)
        module, function = MODULES[name].split(":")
        script = (f"from {module} import {function} as gen\nspec = gen()\nassert spec.name == {name!r}, spec.name\n"
                  "spec.build(verbose=False)\nprint(spec.jit_library_path)")  # fmt: skip
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"building {name} failed (its build folder: {workspace}):\n{result.stderr[-4000:]}")
        so = Path(result.stdout.strip().splitlines()[-1])
        dest = out / name / f"{name}.so"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest)
        print(f"{name}: {dest} ({dest.stat().st_size / 2**20:.1f} MiB)", flush=True)
        built.append(dest)
    if temporary:
        shutil.rmtree(workspace)  # gigabytes of objects: kept only where --workspace asked for them
    return built


def install(modules_dir: Path, site: Path) -> list[Path]:
    """Copy every ``modules_dir/<name>/<name>.so`` of a known module into ``site``'s FlashInfer AOT folder."""
    aot = site / "flashinfer" / "data" / "aot"
    if not (site / "flashinfer").is_dir():
        raise SystemExit(f"--site {site}: no flashinfer package there")
    found = _modules_in(modules_dir)
    placed = []
    for so in found:
        dest = aot / so.stem / so.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest)
        placed.append(dest)
        print(f"{so.stem}: {dest}", flush=True)
    return placed


PACKED = "fi-aot.tar.gz"  # pack's archive; part i is PARTS_DIR/fi-aot-<i>/fi-aot.tar.gz.part<i>, its manifest in fi-aot-00


def _modules_in(modules_dir: Path) -> list[Path]:
    """The ``<name>/<name>.so`` of known modules in ``modules_dir``; ``SystemExit`` naming what is wrong."""
    found = sorted(p for p in modules_dir.glob("*/*.so") if p.stem == p.parent.name)
    check_modules([p.stem for p in found])
    if not found:
        raise SystemExit(f"--modules-dir {modules_dir}: no <name>/<name>.so inside (valid names: {', '.join(MODULES)})")
    return found


def pack(modules_dir: Path, out: Path, max_part_mb: int) -> list[Path]:
    """The modules of ``modules_dir`` as one gzip-compressed tar in parts of at most ``max_part_mb`` MiB,
    part ``i`` alone in ``out/fi-aot-<i>/`` (a folder to copy at a time), with a manifest (the parts,
    their size and the archive's sha256) beside part 0."""
    found = _modules_in(modules_dir)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for so in found:
            archive.add(so, arcname=f"{so.stem}/{so.name}")
    data = buffer.getvalue()
    for stale in out.glob("fi-aot-*"):
        shutil.rmtree(stale)  # parts of an earlier pack would be joined with these
    parts = write_parts(data, max_part_mb << 20, lambda index: out / f"fi-aot-{index:02d}" / f"{PACKED}.part{index:02d}")
    manifest = {"modules": [so.stem for so in found], "parts": len(parts), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / "fi-aot-00" / "fi-aot.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"{', '.join(manifest['modules'])}: {len(parts)} part(s) of <= {max_part_mb} MiB, {len(data) / 2**20:.1f} MiB in all, in {out}/fi-aot-NN", flush=True)
    return parts


def unpack(parts_dir: Path, out: Path) -> list[Path]:
    """Join ``pack``'s parts found in ``parts_dir/fi-aot-*/``, check them against its manifest and extract
    the modules into ``out`` (``out/<name>/<name>.so``, what :func:`install` takes)."""
    manifest_path = parts_dir / "fi-aot-00" / "fi-aot.json"
    if not manifest_path.is_file():
        raise SystemExit(f"--parts-dir {parts_dir}: no fi-aot-00/fi-aot.json (pack's manifest, beside its first part)")
    manifest = json.loads(manifest_path.read_text())
    parts = sorted(parts_dir.glob(f"fi-aot-*/{PACKED}.part*"))
    if len(parts) != manifest["parts"]:
        names = ", ".join(p.name for p in parts) or "none"
        raise SystemExit(f"--parts-dir {parts_dir}: {len(parts)} of {manifest['parts']} parts found ({names}): copy every fi-aot-NN folder")
    data = b"".join(p.read_bytes() for p in parts)
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SystemExit(f"--parts-dir {parts_dir}: the joined parts ({len(data)} bytes) do not match pack's digest ({manifest['bytes']} bytes)")
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        archive.extractall(out, filter="data")
    found = _modules_in(out)
    print(f"{', '.join(p.stem for p in found)}: unpacked into {out}", flush=True)
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build modules with this machine's nvcc (no GPU needed)")
    b.add_argument("--flashinfer-path", type=Path, required=True, help="a folder holding the node's flashinfer and tvm_ffi packages")
    b.add_argument("--modules", nargs="+", required=True, help=f"modules to build: {', '.join(MODULES)}")
    b.add_argument("--out", type=Path, required=True, help="folder to write <name>/<name>.so into")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc jobs (default: the CPU count)")
    b.add_argument("--workspace", type=Path, help="FlashInfer's build folder, kept to resume a build (default: a new temporary one)")
    i = sub.add_parser("install", help="put built modules into a site's FlashInfer AOT folder")
    i.add_argument("--modules-dir", type=Path, required=True, help="a folder of <name>/<name>.so")
    i.add_argument("--site", type=Path, required=True, help="the site-packages folder holding flashinfer (e.g. /tmp/vllm-site)")
    k = sub.add_parser("pack", help="built modules as gzip-compressed parts, one folder each, for copies of limited size")
    k.add_argument("--modules-dir", type=Path, required=True, help="a folder of <name>/<name>.so")
    k.add_argument("--out", type=Path, required=True, help="folder to write fi-aot-NN/ into (those of an earlier pack there are replaced)")
    k.add_argument("--max-part-mb", type=int, default=55, help="largest part in MiB (default 55)")
    u = sub.add_parser("unpack", help="join pack's parts, check them and extract the modules")
    u.add_argument("--parts-dir", type=Path, required=True, help="the folder holding pack's fi-aot-NN/ folders")
    u.add_argument("--out", type=Path, required=True, help="folder to extract <name>/<name>.so into")
    args = parser.parse_args(argv)
    if args.command == "build":
        if args.jobs < 1:
            parser.error(f"--jobs {args.jobs}: must be at least 1")
        build(args.modules, args.flashinfer_path, args.out, args.jobs, args.workspace)
    elif args.command == "pack":
        if args.max_part_mb < 1:
            parser.error(f"--max-part-mb {args.max_part_mb}: must be at least 1")
        pack(args.modules_dir, args.out, args.max_part_mb)
    elif args.command == "unpack":
        unpack(args.parts_dir, args.out)
    else:
        install(args.modules_dir, args.site)


if __name__ == "__main__":
    main()
