"""The C kernels' tests skip only where there is no C compiler; where one is, a failed build fails them."""

from __future__ import annotations

import shutil

import pytest

from llmsched.executor.torch import kernels
from llmsched.executor.torch.kernels import build


@pytest.fixture(scope="session")
def kernels_built() -> None:
    """Builds the kernels' library (once); skips without a C compiler, fails on a compile error."""
    if not kernels.enabled():
        pytest.skip("the C kernels are switched off (LLMSCHED_CPU_KERNELS)")
    cc = build.compiler()
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler here ({' '.join(cc)}): the PyTorch path runs")
    try:
        build.build_library()
    except build.KernelBuildError as e:
        pytest.fail(f"the C kernels do not build with {' '.join(cc)}: {e}", pytrace=False)
    # A process that failed to build them earlier caches None: look again.
    if kernels.library() is None:
        kernels.clear_caches()
    assert kernels.library() is not None, "the C kernels built but their library does not load"
