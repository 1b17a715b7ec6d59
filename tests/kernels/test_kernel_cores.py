"""The kernel cores without torch's tensor library: ``tests/kernels/cpp/cores_test.cpp`` (vec.h,
fused.h's rows, gemv.h, attention.h, moe.h's experts, panel.h's products, amx.h's packer (and tile
product where AMX runs) and woq_core.h's int8,
int4 and fp8 weight-only products against double-precision references) built with
``-DPAGODA_CORE_ONLY``, OpenMP and only torch's include folder, for each x86 variant this CPU runs
and, with Debian's aarch64 cross-compiler, for ARM NEON run under qemu-aarch64 (``.ci/run`` installs ``g++-aarch64-linux-gnu`` and ``qemu-user``; elsewhere
the ARM case is skipped unless ``PAGODA_REQUIRE_AARCH64=1`` makes a missing toolchain a failure). A
core that does not build or gives a wrong number fails here, and so do AVX2 MoE, panel or int4
weight-only outputs whose bits differ from the AVX-512 kernel's (their design notes promise the same
bits)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
import torch

from pagoda.kernels import build, select

pytestmark = pytest.mark.kernels

SOURCE = Path(__file__).parent / "cpp" / "cores_test.cpp"
TORCH_INCLUDE = Path(torch.__file__).parent / "include"
X86 = select.supported_variants() if build._X86 else []
CROSS = ("aarch64-linux-gnu-g++", "qemu-aarch64")


def _flags(extra: list[str], variant: str) -> list[str]:
    return ["-O2", "-std=c++17", "-fopenmp", *extra, "-DPAGODA_CORE_ONLY", f"-DPAGODA_VARIANT_NAME={variant}",
            f"-I{build.CSRC}", f"-I{TORCH_INCLUDE}", str(SOURCE)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Every build started at once (they take seconds each), waited for by the test that runs it."""
    out = tmp_path_factory.mktemp("cores")
    jobs = {}
    cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
    for variant in dict.fromkeys(X86):
        exe = out / variant
        cmd = [*cxx.split(), *_flags(build.VARIANTS[variant], variant), "-o", str(exe)]
        jobs[variant] = (exe, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    if all(shutil.which(tool) for tool in CROSS):
        exe = out / "aarch64"
        cmd = [CROSS[0], *_flags(["-march=armv8-a"], "neon"), "-o", str(exe)]
        jobs["aarch64"] = (exe, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    yield jobs
    for _, proc in jobs.values():
        proc.kill()


def _built(builds, name: str) -> Path:
    exe, proc = builds[name]
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"the {name} kernel cores do not build without ATen:\n{log[-4000:]}"
    return exe


def _check(run: list[str], name: str, lanes: str) -> dict[str, str]:
    """Runs one build's program; returns its digests of the MoE, panel and int4 outputs' bits."""
    done = subprocess.run(run, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{name}: {done.stdout[-4000:]}{done.stderr[-2000:]}"
    summary, digest = done.stdout.splitlines()
    assert summary.startswith(f"ok ({lanes} lanes): "), done.stdout  # the vector width the target has
    checks = int(summary.split(": ")[1].split()[0])
    assert checks > 88_000, done.stdout  # every part of the program ran
    assert digest.startswith("digest "), done.stdout
    return dict(field.split("=") for field in digest.split()[1:])


@pytest.mark.parametrize("variant", list(dict.fromkeys(X86)))
def test_cores_on_each_x86_variant_this_cpu_runs(builds, variant):
    lanes = {"scalar": "scalar, 1", "avx2": "avx2, 8", "avx512": "avx512, 16"}[variant]
    _check([str(_built(builds, variant))], variant, lanes)


def test_avx2_moe_panel_and_int4_give_the_avx512_bits(builds):
    if not {"avx2", "avx512"} <= set(X86):
        pytest.skip("this CPU does not run both the AVX2 and the AVX-512 variant")
    avx2 = _check([str(_built(builds, "avx2"))], "avx2", "avx2, 8")
    avx512 = _check([str(_built(builds, "avx512"))], "avx512", "avx512, 16")
    assert avx2 == avx512


def test_cores_on_aarch64_neon_under_qemu(builds):
    if "aarch64" not in builds:
        if os.environ.get("PAGODA_REQUIRE_AARCH64") == "1":
            pytest.fail(f"PAGODA_REQUIRE_AARCH64=1 but {' or '.join(t for t in CROSS if not shutil.which(t))} "
                        "is missing (apt-get install g++-aarch64-linux-gnu qemu-user)")
        pytest.skip("no aarch64 cross-compiler and qemu-aarch64 here (apt-get install g++-aarch64-linux-gnu qemu-user)")
    _check(["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(_built(builds, "aarch64"))], "aarch64", "neon, 4")
