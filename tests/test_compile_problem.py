"""train.compile's compiler check: inductor's CPU kernels need cc/gcc/g++, Triton's CUDA ones $CC, gcc or clang
(triton/runtime/build.py: "Failed to find C compiler" at the first kernel, a traceback after launch). Without one the
run is refused in one line before it starts; with one it is not."""

from __future__ import annotations

import pytest

from tasks.parallel.compile import compile_problem


def _path_with(tmp_path, names):
    for name in names:
        exe = tmp_path / name
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    return str(tmp_path)


@pytest.mark.parametrize(
    "device, found, missing",
    [
        ("cpu", ["g++"], "C++ compiler and none is on PATH"),
        ("cuda", ["clang"], "Triton builds inductor's CUDA kernels"),
    ],
)
def test_no_compiler_is_one_line_before_launch(tmp_path, monkeypatch, device, found, missing):
    monkeypatch.delenv("CC", raising=False)
    (tmp_path / "none").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no compiler anywhere on it
    line = compile_problem(device)
    assert line and missing in line and "train.compile=false" in line and "\n" not in line
    monkeypatch.setenv("PATH", _path_with(tmp_path, found))
    assert compile_problem(device) is None


def test_cc_names_the_compiler_triton_uses(tmp_path, monkeypatch):
    (tmp_path / "none").mkdir()
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    monkeypatch.setenv("CC", "/opt/cc")
    assert compile_problem("cuda") is None
    assert compile_problem("npu") is None  # torch_npu's torchair backend: not inductor's compilers
