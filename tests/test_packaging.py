"""The wheel installs only `pdserve.*`: a top-level `kernels` would be picked up by
transformers' hub-kernels probe, and `workers`/`cluster` would shadow other projects."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q", "-w", str(out)],
        check=True, capture_output=True,
    )
    (path,) = out.glob("pdserve-*.whl")
    return zipfile.ZipFile(path)


def test_only_pdserve_at_top_level(wheel: zipfile.ZipFile) -> None:
    tops = {name.split("/")[0] for name in wheel.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"pdserve"}


@pytest.mark.parametrize("folder", ["pdserve/kernels", "workers", "cluster"])
def test_every_source_package_is_in_the_wheel(wheel: zipfile.ZipFile, folder: str) -> None:
    names = set(wheel.namelist())
    for init in (ROOT / folder).rglob("__init__.py"):
        dest = (Path("pdserve") / Path(folder).name / init.relative_to(ROOT / folder)).as_posix()
        assert dest in names, f"{init} is not packaged: add it to pyproject's packages"


def test_console_script_points_at_the_cli(wheel: zipfile.ZipFile) -> None:
    entry = next(n for n in wheel.namelist() if n.endswith("entry_points.txt"))
    assert "pdserve = pdserve.cluster.cli:main" in wheel.read(entry).decode()
