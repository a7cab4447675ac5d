"""The kernels' library: built once per source, compiler and CPU; off or unbuildable, PyTorch runs."""

from __future__ import annotations

import logging

import pytest

from llmsched.executor.torch import kernels
from llmsched.executor.torch.attention import PagedAttention
from llmsched.executor.torch.kernels import build

# Skipped only without a C compiler; a kernel that fails to compile fails these.
needs_kernels = pytest.mark.usefixtures("kernels_built")


def test_switched_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("LLMSCHED_CPU_KERNELS", "0")
    kernels.clear_caches()
    try:
        assert kernels.library() is None
        assert kernels.decode_attention() is None
        assert kernels.prefill_attention() is None
        assert kernels.prefill_attention_f32() is None
        assert kernels.rms_norm_kernels() is None
        assert kernels.swiglu_kernel() is None
        attn = PagedAttention(4, 2, 64, 16, keys_transposed=True)
        assert attn.kernels is None and attn.prefill_kernel is None and attn.prefill_kernel_f32 is None
    finally:
        kernels.clear_caches()


def test_no_compiler_is_reported_and_the_pytorch_path_runs(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.KernelBuildError, match="no-such-cc"):
        build.build_library()
    kernels.clear_caches()
    try:
        with caplog.at_level(logging.WARNING):
            assert kernels.decode_attention() is None
        assert "no-such-cc" in caplog.text and "PyTorch path" in caplog.text
    finally:
        kernels.clear_caches()


def test_a_failing_compile_names_the_error(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\necho 'boom: bad flag' >&2\nexit 3\n"
    )
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(tmp_path))
    with pytest.raises(build.KernelBuildError, match="failed \\(3\\): boom: bad flag"):
        build.build_library()
    assert not list((tmp_path / "kernels").glob("*.so"))


@needs_kernels
def test_the_library_is_built_once_per_source_compiler_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMSCHED_CACHE_DIR", str(tmp_path))
    first = build.build_library()
    assert first.parent == tmp_path / "kernels" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert build.build_library() == first and first.stat().st_mtime_ns == stamp
    monkeypatch.setattr(build, "_cpu_signature", lambda: "another CPU")
    assert build.library_path() != first
