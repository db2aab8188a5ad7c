#!/usr/bin/env python
"""Transformer Engine for the GPU machine (torch 2.11.0+cu130, Python 3.12, Hopper), prepared here from
the package registry only, and cut into carry-sized pieces.

    python bench/prepare_te.py [--work .te-build] [--carry .carry] [--jobs 2] [--arch 90]

Steps (each function below; ``WORK/prepare.json`` records sizes and seconds):

  download   ``transformer-engine-cu13`` (the core wheel: Python code and ``libtransformer_engine.so``,
             fat binaries for sm_75 ... sm_120), the ``transformer-engine-torch`` source distribution
             (the PyTorch extension, compiled against the torch that imports it), torch 2.11.0 (the CUDA 13
             build the GPU machine has, to build against) and the Python 3.12 wheels TE imports that the
             GPU image lacks (pydantic and its parts; nvidia-cudnn-frontend without its dependencies, whose
             headers build the extension), and the ``transformer-engine``
             metapackage TE's import checks for.
  cut        the core wheel rewritten with its library cut to ``--arch`` (``bench/_fatbin.py``: each fat
             binary keeps the entries a device of that arch loads, byte for byte, checked against the
             original, and NVIDIA's cuobjdump, from the registry, extracts the same sm_90 cubins from
             both): a 30.9 MiB wheel instead of 263.7 MiB (276.5 MB).
  build      ``transformer-engine-torch`` built as a cp312 wheel in a Python 3.12 virtual environment
             (``WORK/venv``: torch 2.11.0 with its CUDA 13 header packages, pybind11, ninja), with this
             machine's nvcc (CUDA 13.0), ``MAX_JOBS=--jobs``, niced; ``--no-build`` leaves it to the GPU
             machine (``WORK/stage/build/`` then carries the source distribution and its headers' wheel).
  pieces     ``WORK/stage`` (the wheels to install there) split by ``bench/_carry.py`` into
             ``CARRY/te.1``, ``CARRY/te.2``, ... (each under 60 MiB, git-ignored, with the manifest).

On the GPU machine: ``python bench/carry_pieces.py install --root .carry --name te --target WORK/site``
(docs/gpu.md gives the calls).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any, Dict, List, Optional

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))

import _carry  # noqa: E402
import _fatbin  # noqa: E402

TE_VERSION = "2.20.2"  # --te-version; 2.12.0 is the newest whose library links against torch 2.11.0's cuBLAS pin
CORE = "transformer-engine-cu13"
# The metapackage (a small pure wheel): TE's import checks that it is installed at the core's version.
META = "transformer-engine"
EXT = "transformer-engine-torch"
TORCH = "torch==2.11.0"  # the GPU machine's: 2.11.0+cu130 (CUDA 13.0) on Python 3.12
# What transformer_engine.pytorch imports that the GPU image lacks (its package list has no pydantic;
# pip resolves pydantic's own parts, less what the image has).
RUNTIME = ("pydantic",)
ON_THE_MACHINE = ("typing-extensions",)
# Without its dependencies: the cuDNN frontend, whose headers build the extension (TE imports its Python
# part only in fused grouped MLPs); its dependencies (cuda-bindings, CUTLASS's DSL, ...) would shadow the
# image's own.
RUNTIME_NO_DEPS = ("nvidia-cudnn-frontend==1.32.0",)
INDEX = "https://pypi.org/simple"
LIB = "transformer_engine/wheel_lib/libtransformer_engine.so"
PIP_TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--platform",
              "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


class PrepareError(Exception):
    """A step that failed; the message says which and why."""


def _run(cmd: List[str], log: Path, env: Optional[Dict[str, str]] = None, cwd: Optional[Path] = None) -> float:
    """Run ``cmd`` with its output in ``log``; seconds taken. Raises PrepareError with the log's tail."""
    t0 = time.monotonic()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f:
        f.write("$ " + " ".join(map(str, cmd)) + "\n")
        f.flush()
        try:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        except OSError as e:  # the program itself is missing or not executable
            raise PrepareError(f"{cmd[0]}: {e.strerror}") from None
    if r.returncode:
        raise PrepareError(f"{' '.join(map(str, cmd[:6]))} ... exited {r.returncode}; "
                           f"{log}: {log.read_text()[-600:]}")
    return time.monotonic() - t0


def python312() -> str:
    """pyenv's Python 3.12 (the GPU machine's minor version)."""
    for c in sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python"), reverse=True):
        return str(c)
    found = shutil.which("python3.12")
    if not found:
        raise PrepareError("no Python 3.12 here (looked for ~/.pyenv/versions/3.12*/bin/python and python3.12)")
    return found


def sdist(name: str, version: str, dest: Path) -> Path:
    """The source distribution of ``name==version`` from the registry's simple index (its JSON form),
    checked against the index's sha256. ``pip download`` would run its setup, which needs torch."""
    req = urllib.request.Request(f"{INDEX}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    want = f"{name.replace('-', '_')}-{version}.tar.gz"
    entry = next((f for f in files if f["filename"] == want), None)
    if entry is None:
        raise PrepareError(f"the index has no {want}")
    out = dest / want
    if not (out.exists() and _carry.sha256_file(out) == entry["hashes"]["sha256"]):
        with urllib.request.urlopen(entry["url"], timeout=300) as r:
            data = r.read()
        if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
            raise PrepareError(f"{want}: sha256 differs from the index's")
        out.write_bytes(data)
    return out


def download(work: Path, py: str, version: str = TE_VERSION) -> Dict[str, Any]:
    dl, runtime = work / "dl", work / "dl" / "runtime"
    runtime.mkdir(parents=True, exist_ok=True)
    t = _run([py, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, f"{CORE}=={version}", f"{META}=={version}",
              "-d", str(dl)],
             work / "logs" / "core.log")
    shutil.rmtree(runtime)
    runtime.mkdir()
    t += _run([py, "-m", "pip", "download", "-q", *PIP_TARGET, *RUNTIME, "-d", str(runtime)], work / "logs" / "runtime.log")
    t += _run([py, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, *RUNTIME_NO_DEPS, "-d", str(runtime)],
              work / "logs" / "runtime_no_deps.log")
    for w in runtime.glob("*.whl"):
        if _dist(w.name) in ON_THE_MACHINE:
            w.unlink()
    t0 = time.monotonic()
    src = sdist(EXT, version, dl)
    return {"seconds": round(t + time.monotonic() - t0, 1), "core": str(core_wheel(work, version)), "sdist": str(src),
            "runtime": sorted(w.name for w in runtime.glob("*.whl"))}


def _dist(filename: str) -> str:
    return filename.split("-")[0].replace("_", "-").lower()


def core_wheel(work: Path, version: str = TE_VERSION) -> Path:
    found = sorted((work / "dl").glob(f"transformer_engine_cu13-{version}-*.whl"))
    if not found:
        raise PrepareError(f"no transformer_engine_cu13-{version} wheel in {work / 'dl'}: run the download step")
    return found[0]


def _record_line(name: str, data: bytes) -> str:
    import base64

    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def cuobjdump(work: Path, py: str) -> Path:
    """NVIDIA's cuobjdump, from the registry's ``nvidia-cuda-cuobjdump`` wheel (this machine's CUDA lacks it)."""
    tools = work / "tools"
    found = sorted(tools.glob("**/bin/cuobjdump"))
    if not found:
        _run([py, "-m", "pip", "download", "-q", "--no-deps", *PIP_TARGET, "nvidia-cuda-cuobjdump", "-d", str(tools)],
             work / "logs" / "cuobjdump.log")
        for w in tools.glob("nvidia_cuda_cuobjdump-*.whl"):
            with zipfile.ZipFile(w) as z:
                z.extractall(tools)
        found = sorted(tools.glob("**/bin/cuobjdump"))
        if not found:
            raise PrepareError(f"no cuobjdump in the nvidia-cuda-cuobjdump wheel under {tools}")
        found[0].chmod(0o755)
    return found[0]


def cubins(tool: Path, lib: Path, dest: Path, arch: int) -> List[str]:
    """sha256 of each sm_ARCH* ELF cubin that ``cuobjdump -xelf all`` extracts from ``lib``, sorted."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    _run([str(Path(tool).resolve()), "-xelf", "all", str(lib.resolve())], dest.parent / f"{dest.name}.log", cwd=dest)
    out = sorted(_carry.sha256_file(p) for p in dest.glob(f"*.sm_{arch}*.cubin"))
    shutil.rmtree(dest)
    return out


def cut_core(src: Path, dst: Path, arch: int, scratch: Path, tool: Optional[Path] = None) -> Dict[str, Any]:
    """``src`` (the core wheel) written to ``dst`` with its library cut to ``arch`` and checked
    (``_fatbin.verify_cut``; with ``tool``, NVIDIA's cuobjdump must extract from the cut library exactly
    the original's sm_ARCH cubins, byte for byte), its RECORD line rewritten; every other member as it was."""
    t0 = time.monotonic()
    scratch.mkdir(parents=True, exist_ok=True)
    full, cut = scratch / "full.so", scratch / "cut.so"
    checked: Dict[str, Any] = {}
    with zipfile.ZipFile(src) as z:
        full.write_bytes(z.read(LIB))
        report = _fatbin.cut(full, cut, (arch,))
        _fatbin.verify_cut(full, cut, (arch,))
        if tool is not None:
            before, after = cubins(tool, full, scratch / "x_full", arch), cubins(tool, cut, scratch / "x_cut", arch)
            if before != after or not after:
                raise PrepareError(f"cuobjdump extracts {len(after)} sm_{arch} cubins from the cut library, "
                                   f"{len(before)} from the original, not the same bytes")
            checked = {"cuobjdump": str(tool), "sm_cubins_identical": len(after)}
        new = cut.read_bytes()
        dst.parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as out:
            for info in z.infolist():
                data = new if info.filename == LIB else z.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    lines = [(_record_line(LIB, new) if line.startswith(LIB + ",") else line)
                             for line in data.decode().splitlines()]
                    data = ("\n".join(lines) + "\n").encode()
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    full.unlink()
    cut.unlink()
    mib = {k: round(sum(v["bytes"] for v in report[k].values()) / 2**20, 1) for k in ("before", "after")}
    return {"seconds": round(time.monotonic() - t0, 1), "arch": arch, "fatbin_mib": mib,
            "entries_after": report["after"], "containers": report["containers"], "left_whole": report["left_whole"],
            **checked,
            "wheel_mib": {"before": round(src.stat().st_size / 2**20, 1), "after": round(dst.stat().st_size / 2**20, 1)}}


def make_venv(work: Path, py: str) -> Path:
    """``WORK/venv``: Python 3.12 with torch 2.11.0 (its CUDA 13 packages hold the headers), pybind11,
    ninja and the cuDNN frontend's headers; what the extension builds against."""
    venv = work / "venv"
    vpy = venv / "bin" / "python"
    if not vpy.exists():
        _run([py, "-m", "venv", str(venv)], work / "logs" / "venv.log")
    _run([str(vpy), "-m", "pip", "install", "-q", TORCH, "nvidia-cudnn-frontend>=1.29.0", "pybind11", "ninja",
          "setuptools", "wheel", "packaging"], work / "logs" / "venv-install.log")
    return vpy


def header_dirs(vpy: Path) -> List[str]:
    """The include folders of the venv's NVIDIA packages (cuDNN, NCCL, cuBLAS, ...) and the cuDNN frontend."""
    site = Path(subprocess.check_output([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    dirs = sorted(str(p) for p in site.glob("nvidia/*/include")) + sorted(str(p) for p in site.glob("include"))
    dirs += sorted(str(p.parent) for p in site.glob("**/cudnn_frontend.h"))
    return list(dict.fromkeys(dirs))


def build_extension(work: Path, vpy: Path, arch: int, jobs: int, out: Path, version: str = TE_VERSION) -> Dict[str, Any]:
    """Build ``transformer-engine-torch`` into a wheel in ``out`` against the venv's torch."""
    src_tar = sdist(EXT, version, work / "dl")
    src_root = work / "src"
    shutil.rmtree(src_root, ignore_errors=True)
    with tarfile.open(src_tar) as t:
        t.extractall(src_root)
    src = next(src_root.iterdir())
    env = dict(os.environ, MAX_JOBS=str(jobs), NVTE_PYTORCH_FORCE_BUILD="TRUE", NVTE_CUDA_ARCHS=str(arch),
               NVTE_WITH_NCCL_EP="0", CUDA_HOME=os.environ.get("CUDA_HOME", "/usr/local/cuda"),
               CPATH=os.pathsep.join(header_dirs(vpy) + [p for p in [os.environ.get("CPATH")] if p]))
    out.mkdir(parents=True, exist_ok=True)
    seconds = _run(["nice", "-n", "10", str(vpy), "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                    "-w", str(out), str(src)], work / "logs" / "build.log", env=env)
    wheel = next(out.glob("transformer_engine_torch-*.whl"))
    return {"seconds": round(seconds, 1), "jobs": jobs, "wheel": wheel.name,
            "wheel_mib": round(wheel.stat().st_size / 2**20, 1)}


def prepare(work: Path, carry: Path, arch: int, jobs: int, build: bool, version: str = TE_VERSION,
            log=print) -> Dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {"te_version": version, "arch": arch, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def record(step: str, value: Dict[str, Any]) -> None:
        report[step] = value
        (work / "prepare.json").write_text(json.dumps(report, indent=1) + "\n")
        log(f"prepare_te: {step}: {json.dumps(value)[:400]}")

    py = python312()
    record("download", download(work, py, version))
    stage = work / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "wheels").mkdir(parents=True)
    core = core_wheel(work, version)
    record("cut", cut_core(core, stage / "wheels" / core.name, arch, work / "scratch", cuobjdump(work, py)))
    for w in [*(work / "dl" / "runtime").glob("*.whl"), *(work / "dl").glob(f"transformer_engine-{version}-*.whl")]:
        shutil.copy(w, stage / "wheels" / w.name)
    if build:
        t0 = time.monotonic()
        vpy = make_venv(work, py)
        venv_s = time.monotonic() - t0
        record("build", dict(build_extension(work, vpy, arch, jobs, stage / "wheels", version),
                             venv_seconds=round(venv_s, 1)))
    else:  # built on the GPU machine: the source distribution travels
        (stage / "build").mkdir()
        shutil.copy(sdist(EXT, version, work / "dl"), stage / "build")
        record("build", {"where": "the GPU machine (--no-build)"})
    m = _carry.split(stage, carry, "te")
    record("pieces", {"count": len(m["pieces"]), "mib": [round(p["bytes"] / 2**20, 1) for p in m["pieces"]],
                      "total_mib": round(m["bytes"] / 2**20, 1), "folders": [str(carry / p["folder"]) for p in m["pieces"]],
                      "files": [(f["path"], round(f["bytes"] / 2**20, 2)) for f in m["files"]]})
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Prepare Transformer Engine for the GPU machine and cut it into "
                                            "carry-sized pieces (bench/prepare_te.py's docstring says how).")
    p.add_argument("--work", default=str(REPO / ".te-build"), help="downloads, venv, build (default .te-build, git-ignored)")
    p.add_argument("--carry", default=str(REPO / ".carry"), help="the piece folders (default .carry, git-ignored)")
    p.add_argument("--te-version", default=TE_VERSION,
                   help=f"Transformer Engine release (default {TE_VERSION}; docs/gpu.md: 2.12.0 if the GPU image's "
                        "cuBLAS is torch 2.11.0's pin)")
    p.add_argument("--arch", type=int, default=90, help="the compute capability to keep, as 90 for sm_90 (default 90)")
    p.add_argument("--jobs", type=int, default=2, help="MAX_JOBS of the extension's build (default 2)")
    p.add_argument("--no-build", action="store_true", help="carry the extension's source; build it on the GPU machine")
    a = p.parse_args(argv)
    if a.arch < 50 or a.arch > 200:
        p.error(f"--arch {a.arch}: give a compute capability as 90 for sm_90")
    if a.jobs < 1:
        p.error(f"--jobs must be at least 1 (got {a.jobs})")
    try:
        prepare(Path(a.work), Path(a.carry), a.arch, a.jobs, not a.no_build, a.te_version)
    except (PrepareError, _carry.CarryError, _fatbin.FatbinError) as e:
        print(f"prepare_te: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
