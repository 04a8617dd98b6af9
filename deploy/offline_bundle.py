#!/usr/bin/env python3
"""Offline bundles of the Python packages a GPU node lacks, for nodes without internet.

``build`` runs where PyPI is reachable: it downloads the wheels of the chosen
package sets for the node's Python and platform, unpacks them into one
site-packages tree, drops the parts prefill never uses (Ray's Java jars and
RLlib/Tune/Train/Data/LLM libraries, FlashInfer's kernel sources other than the
ones its JIT needs), packs the tree as ``.tar.xz`` and splits it into parts of
at most ``--max-part-mb`` (a transfer limit, an artifact size limit, ...).

``install`` runs on the node with nothing but Python: it checks every part's
SHA-256 against the manifest, joins and unpacks them into ``--target``, and
writes a ``sitecustomize.py`` there so that packages shipping ``.pth`` files
(flash-attn 4's CuTe DSL) work when ``--target`` is on ``PYTHONPATH``; Ray
workers inherit ``PYTHONPATH`` from the driver that starts a local cluster.

    python deploy/offline_bundle.py build --sets ray,flashinfer --out .bundle/gpu
    python deploy/offline_bundle.py install --bundle .bundle/gpu --target /tmp/mlapool-site
    export PYTHONPATH=/tmp/mlapool-site${PYTHONPATH:+:$PYTHONPATH}

The sets hold what the project's GPU image lacks (it has torch, triton, numpy,
msgpack, safetensors, aiohttp, grpcio, protobuf, pyyaml, prometheus-client, ...):
``ray`` for the pool and the batch job, ``serve`` on top of it for the Serve tier
and Ray's Prometheus export, ``flashinfer``, ``flash-attn-4`` and ``nixl``; and
``vllm``, a vLLM 0.26.0 decode server for the KV connector (``kv.vllm_connector``),
which is bundled alone, as wheels that ``install`` hands to pip (``--no-index
--no-deps --target``), for a site of its own:

    python deploy/offline_bundle.py build --sets vllm --max-part-mb 55 --out .bundle/vllm
    python deploy/offline_bundle.py install --bundle .bundle/vllm --target /tmp/vllm-site

Only the standard library is used (and pip, for a wheels bundle's install).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

SETS: dict[str, dict] = {
    "ray": {
        "packages": [
            "ray==2.60.0",
            "jsonschema==4.26.0",
            "jsonschema-specifications==2025.9.1",
            "referencing==0.37.0",
            "rpds-py==0.30.0",
        ],
        "prune": ["ray/jars", "ray/rllib", "ray/tune", "ray/train", "ray/data", "ray/llm"],
    },
    "flashinfer": {
        "packages": ["flashinfer-python==0.7.2.post1", "apache-tvm-ffi==0.1.15.post2"],
        # its JIT needs data/include, data/cutlass, data/cccl, data/spdlog and the top-level data/csrc files
        "prune": ["flashinfer/data/csrc/*/"],
    },
    "nixl": {  # KV handoff to decode servers (kv.nixl); needs torch and numpy, which the node has
        "packages": ["nixl-cu13==1.5.1"],
        "prune": [],
    },
    "serve": {  # Ray Serve (cluster.serve) and Ray's metrics agent (Prometheus export), over the ray set
        "packages": [
            "fastapi==0.165.0",
            "starlette==1.10.0",
            "uvicorn==0.54.0",
            "pydantic==2.13.4",
            "pydantic-core==2.46.4",
            "annotated-types==0.7.0",
            "typing-inspection==0.4.2",
            "typing-extensions==4.16.0",  # pydantic needs >= 4.14.1; the node's may be older
            "opentelemetry-api==1.45.2",
            "opentelemetry-sdk==1.45.2",
            "opentelemetry-semantic-conventions==0.66b2",
            "opentelemetry-exporter-prometheus==0.66b2",
            "opentelemetry-proto==1.45.2",
            "opencensus==0.11.4",
            "opencensus-context==0.1.3",
            "googleapis-common-protos==1.76.0",
            "watchfiles==1.3.0",  # imported by the serve CLI
            "colorful==0.5.8",
            "aiohttp-cors==0.8.1",
            # Serve's gRPC proxy imports grpc_reflection, which needs grpcio and protobuf at least as new as itself
            "grpcio-reflection==1.85.1",
            "grpcio==1.85.1",
            "protobuf==7.36.2",
        ],
        "prune": [],
    },
    "vllm": {  # a vLLM 0.26.0 decode server (the last release on torch 2.11) with mlapool's connector:
        # vLLM and what it needs that the GPU image lacks, resolved by `uv pip compile` for Python 3.12 on
        # x86_64 manylinux_2_28 (2026-11-24) less the image's packages (CUDA 13: no cu12 libraries; its
        # cuda-bindings, cuda-core and toolkit stand for cuda-python and nvidia-nvvm), less five large ones
        # a DeepSeek-architecture model never imports (tokenspeed-triton, tilelang, pynvvideocodec,
        # z3-solver, torchcodec); plus NIXL for the connector. Kept as wheels (already compressed) and
        # installed by pip into a site of its own: its cutlass-dsl 4.6.0 is not FA4's 4.8.1.
        "wheels": True,
        "packages": [
            "agent-detector==2.0.0",
            "annotated-types==0.8.0",
            "anthropic==2.13.0",
            "apache-tvm-ffi==0.1.10",
            "astor==0.8.1",
            "blake3==1.0.11",
            "cachetools==8.0.2",
            "cbor2==6.3.0",
            "cffi==2.1.1",
            "compressed-tensors==0.17.0",
            "cryptography==50.0.2",
            "cuda-tile==1.7.0",
            "depyf==0.20.0",
            "detect-installer==0.2.1",
            "dill==0.4.1",
            "dnspython==2.9.2",
            "docstring-parser==0.18.0",
            "email-validator==2.4.0",
            "fastapi==0.136.3",
            "fastapi-cli==0.0.34",
            "fastapi-cloud-cli==0.28.0",
            "fastar==0.12.0",
            "fastsafetensors==0.5.0",
            "flashinfer-python==0.6.14",
            "googleapis-common-protos==1.76.0",
            "httpcore2==2.16.2",
            "httptools==0.9.0",
            "httpx2==2.16.2",
            "humming-kernels==0.1.10",
            "ijson==3.6.0",
            "interegular==0.3.3",
            "jiter==0.19.0",
            "jmespath==1.1.0",
            "jsonschema==4.26.0",
            "jsonschema-specifications==2025.9.1",
            "lark==1.2.2",
            "llguidance==1.7.6",
            "lm-format-enforcer==0.11.3",
            "loguru==0.7.3",
            "mcp==2.3.0",
            "mcp-types==2.3.0",
            "mistral-common==1.13.1",
            "model-hosting-container-standards==0.1.16",
            "msgspec==0.22.0",
            "nvidia-cudnn-frontend==1.28.0",
            "nvidia-cutlass-dsl==4.6.0",
            "nvidia-cutlass-dsl-libs-base==4.6.0",
            "nvidia-cutlass-dsl-libs-core==4.6.0",
            "nvidia-cutlass-dsl-libs-cu13==4.6.0",
            "nvtx==0.2.15",
            "openai==3.57.0",
            "openai-harmony==0.0.8",
            "opentelemetry-api==1.45.2",
            "opentelemetry-exporter-http-transport==0.66b2",
            "opentelemetry-exporter-otlp==1.45.2",
            "opentelemetry-exporter-otlp-common==0.66b2",
            "opentelemetry-exporter-otlp-proto-common==1.45.2",
            "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
            "opentelemetry-exporter-otlp-proto-http==1.45.2",
            "opentelemetry-proto==1.45.2",
            "opentelemetry-sdk==1.45.2",
            "opentelemetry-semantic-conventions==0.66b2",
            "opentelemetry-semantic-conventions-ai==0.5.1",
            "outlines-core==0.2.14",
            "partial-json-parser==0.2.1.1.post7",
            "prometheus-fastapi-instrumentator==8.1.0",
            "pybase64==1.5.1",
            "pycountry==26.2.16",
            "pycparser==3.12",
            "pydantic==2.14.4",
            "pydantic-core==2.50.5",
            "pydantic-extra-types==2.11.1",
            "pydantic-settings==2.16.3",
            "pyelftools==0.33",
            "pyjwt==2.15.1",
            "python-dotenv==1.2.4",
            "python-json-logger==4.2.0",
            "python-multipart==0.0.34",
            "pyzmq==27.3.0",
            "quack-kernels==0.6.3",
            "referencing==0.37.0",
            "rich-toolkit==0.20.6",
            "rignore==0.8.1",
            "rpds-py==2026.9.1",
            "sentry-sdk==2.75.0",
            "setproctitle==1.3.8",
            "sniffio==1.3.1",
            "sse-starlette==3.7.0",
            "starlette==1.10.0",
            "supervisor==4.3.0",
            "tokenspeed-mla==0.1.8",
            "torch-c-dlpack-ext==0.1.5",
            "truststore==0.10.5",
            "typing-inspection==0.4.5",  # pydantic 2.14 needs it newer than the image's
            "uvicorn==0.54.0",
            "vllm==0.26.0",
            "watchfiles==1.3.0",
            "websockets==17.4",
            "xgrammar==0.2.7",
            "nixl-cu13==1.5.1",
        ],
        "prune": [],
    },
    "flash-attn-4": {
        "packages": [
            "flash-attn-4==4.0.0b36",
            "nvidia-cutlass-dsl==4.8.1",
            "nvidia-cutlass-dsl-libs-base==4.8.1",
            "nvidia-cutlass-dsl-libs-core==4.8.1",
            "nvidia-cutlass-dsl-libs-cu13==4.8.1",
            "quack-kernels==0.6.5",
            "torch-c-dlpack-ext==0.1.5",
            "apache-tvm-ffi==0.1.15.post2",
        ],
        "prune": [],
    },
}
MANIFEST = "manifest.json"
SITECUSTOMIZE = """\
# Written by mlapool's offline bundle: process this folder's .pth files when it is on PYTHONPATH.
import os, site
site.addsitedir(os.path.dirname(os.path.abspath(__file__)))
"""


def build(sets: list[str], out: Path, python: str, platforms: list[str], max_part_mb: float) -> Path:
    unknown = [s for s in sets if s not in SETS]
    if unknown:
        raise SystemExit(f"unknown package set(s) {unknown}; valid: {', '.join(SETS)}")
    as_wheels = {s for s in sets if SETS[s].get("wheels")}
    if as_wheels and len(sets) > 1:
        raise SystemExit(f"set(s) {sorted(as_wheels)} are bundled as wheels, installed into a site of their own: build them alone")
    packages = sorted({p for s in sets for p in SETS[s]["packages"]})
    prune = [rule for s in sets for rule in SETS[s]["prune"]]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        wheels, tree = Path(tmp, "wheels"), Path(tmp, "site")
        _download(packages, wheels, python, platforms)
        if as_wheels:
            tree = wheels  # a tar of the wheels as they are: zips, nothing left to compress
            removed = []
        else:
            for wheel in sorted(wheels.glob("*.whl")):
                _unpack_wheel(wheel, tree)
            removed = _prune(tree, prune)
        name = f"mlapool-bundle-{'-'.join(sets)}-cp{python.replace('.', '')}"
        parts = _pack(tree, out, name, int(max_part_mb * 2**20), compress=not as_wheels)
    manifest = {
        "name": name,
        "wheels": bool(as_wheels),
        "python": python,
        "platforms": platforms,
        "packages": packages,
        "pruned": removed,
        "parts": [{"file": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)} for p in parts],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    total = sum(p["bytes"] for p in manifest["parts"]) / 2**20
    print(f"{out}: {len(parts)} part(s), {total:.1f} MiB, {len(packages)} packages")
    return out


def install(bundle: Path, target: Path) -> None:
    manifest = json.loads((bundle / MANIFEST).read_text())
    data = io.BytesIO()
    for part in manifest["parts"]:
        path = bundle / part["file"]
        if not path.is_file():
            raise SystemExit(f"bundle part {path} is missing; the manifest lists {len(manifest['parts'])} parts")
        if _sha256(path) != part["sha256"]:
            raise SystemExit(f"bundle part {path} is corrupt: its SHA-256 does not match the manifest")
        data.write(path.read_bytes())
    data.seek(0)
    target.mkdir(parents=True, exist_ok=True)
    if manifest.get("wheels"):
        with tempfile.TemporaryDirectory() as tmp, tarfile.open(fileobj=data, mode="r:") as archive:
            archive.extractall(tmp, filter="data")
            cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile", "--target", str(target)]
            subprocess.run(cmd + sorted(str(w) for w in Path(tmp).glob("*.whl")), check=True)
    else:
        with tarfile.open(fileobj=data, mode="r:xz") as archive:
            archive.extractall(target, filter="data")
    (target / "sitecustomize.py").write_text(SITECUSTOMIZE)
    print(f"installed {len(manifest['packages'])} packages into {target}: export PYTHONPATH={target}${{PYTHONPATH:+:$PYTHONPATH}}")


def _download(packages: list[str], dest: Path, python: str, platforms: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", python, "--implementation", "cp", "-d", str(dest)]  # fmt: skip
    for platform in platforms:
        cmd += ["--platform", platform]
    subprocess.run(cmd + packages, check=True)


def _unpack_wheel(wheel: Path, tree: Path) -> None:
    """Unzip a wheel keeping its files' modes (``extractall`` drops them: Ray ships executables)."""
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            path = Path(archive.extract(info, tree))
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                path.chmod(mode)


def _prune(tree: Path, rules: list[str]) -> list[str]:
    """Delete what the rules name (``dir`` or ``glob/*/`` for sub-directories); return the paths removed."""
    removed = []
    for rule in rules:
        directories_only = rule.endswith("/")
        parent, _, pattern = rule.rstrip("/").rpartition("/")
        base = tree / parent
        if not base.is_dir():
            raise SystemExit(f"prune rule {rule!r} matches nothing: {parent} is not in the bundle")
        for entry in sorted(base.iterdir()):
            if fnmatch.fnmatch(entry.name, pattern) and (entry.is_dir() or not directories_only):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                removed.append(str(entry.relative_to(tree)))
    return removed


def _pack(tree: Path, out: Path, name: str, max_part_bytes: int, compress: bool) -> list[Path]:
    archive = out / (f"{name}.tar.xz" if compress else f"{name}.tar")
    with tarfile.open(archive, "w:xz", preset=9) if compress else tarfile.open(archive, "w") as tar:
        for entry in sorted(tree.iterdir()):
            tar.add(entry, arcname=entry.name)
    for old in out.glob(f"{name}.tar*.part*"):
        old.unlink()
    blob = archive.read_bytes()
    archive.unlink()
    return write_parts(blob, max_part_bytes, lambda index: out / f"{archive.name}.part{index:02d}")


def write_parts(blob: bytes, max_part_bytes: int, path_of) -> list[Path]:
    """``blob`` cut into parts of at most ``max_part_bytes``, part ``i`` written to ``path_of(i)`` (its
    folder made); the parts' paths."""
    parts = []
    for index, start in enumerate(range(0, len(blob), max_part_bytes)):
        part = path_of(index)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(blob[start : start + max_part_bytes])
        parts.append(part)
    return parts


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="download, prune, pack and split a bundle (needs PyPI)")
    b.add_argument("--sets", default="ray,flashinfer", help=f"comma-separated package sets: {', '.join(SETS)} (default: ray,flashinfer)")
    b.add_argument("--out", type=Path, required=True, help="folder for the parts and manifest.json")
    b.add_argument("--python", default="3.12", help="the node's Python version (default: 3.12)")
    b.add_argument("--platform", action="append", dest="platforms",
                   help="pip platform tag, repeatable (default: x86_64 manylinux_2_17 to 2_35, for the GPU image's glibc 2.39, and any)")  # fmt: skip
    b.add_argument("--max-part-mb", type=float, default=60.0, help="largest part in MiB (default: 60)")
    i = sub.add_parser("install", help="check, join and unpack a bundle (stdlib only, no network)")
    i.add_argument("--bundle", type=Path, required=True, help="folder with manifest.json and the parts")
    i.add_argument("--target", type=Path, required=True, help="folder to unpack into; put it on PYTHONPATH")
    args = parser.parse_args(argv)
    if args.command == "build":
        platforms = args.platforms or [f"manylinux_2_{minor}_x86_64" for minor in (35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64", "any"]
        build([s.strip() for s in args.sets.split(",") if s.strip()], args.out, args.python, platforms, args.max_part_mb)
    else:
        install(args.bundle, args.target)


if __name__ == "__main__":
    os.umask(0o022)
    main()
