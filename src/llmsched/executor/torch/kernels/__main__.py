"""``python -m llmsched.executor.torch.kernels``: build the C kernels now (``make`` runs it at install)."""

from __future__ import annotations

import sys

from llmsched.executor.torch.kernels.build import KernelBuildError, build_library


def main() -> int:
    """Build (or find) the library and say where it is; a failure is reported, not fatal to an install."""
    try:
        print(f"CPU kernels: {build_library(force='--force' in sys.argv)}")
    except KernelBuildError as e:
        print(f"CPU kernels not built, the PyTorch path will run: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
