"""Imports go one way, cluster -> workers -> kernels, and `ruff check .` (CI) enforces it.

workers/ruff.toml and pdserve/kernels/ruff.toml extend the root's ruff settings with banned imports
(flake8-tidy-imports' banned-api, TID251: a banned module bans its submodules, `from pkg import
module` and attribute access too) and no relative import from a parent package (TID252, which
would get around the names). Here the rule runs on the real tree, and on a copy of its ruff
settings with an upward import planted under each layer."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("workers", "pdserve/kernels")  # the folders with bans of their own (cluster/ may import anything)


def _ruff(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`ruff check` as CI runs it, with each file's nearest config."""
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The repository's ruff settings in an empty tree of the same shape."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for layer in (*LAYERS, "cluster"):
        (tmp_path / layer).mkdir(parents=True)
        (tmp_path / layer / "__init__.py").touch()
    for layer in LAYERS:
        shutil.copy(ROOT / layer / "ruff.toml", tmp_path / layer)
    return tmp_path


def test_the_tree_keeps_the_layering() -> None:
    """No upward import today; Ray, FastAPI and Prometheus stay in cluster/."""
    run = _ruff(ROOT, "--select", "TID251,TID252", "cluster", "workers", "pdserve/kernels")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize(("layer", "source", "says"), [
    ("workers", "import pdserve.cluster.serve_config", "`pdserve.cluster` is banned"),
    ("workers", "from pdserve.cluster.router.policy import RoutingPolicy", "`pdserve.cluster` is banned"),
    ("workers", "from pdserve import cluster", "`pdserve.cluster` is banned"),
    ("workers", "def later():\n    from pdserve.cluster import cli\n    return cli", "`pdserve.cluster` is banned"),
    ("workers", "import ray", "`ray` is banned"),
    ("workers", "from ray.util import queue", "`ray` is banned"),
    ("workers", "from fastapi import FastAPI", "`fastapi` is banned"),
    ("workers", "from starlette.requests import Request", "`starlette` is banned"),
    ("workers", "import uvicorn", "`uvicorn` is banned"),
    ("workers", "from prometheus_client import Counter", "`prometheus_client` is banned"),
    ("workers", "from ..cluster import serve_config", "TID252"),
    ("pdserve/kernels", "from pdserve.workers.config import EngineConfig", "`pdserve.workers` is banned"),
    ("pdserve/kernels", "import pdserve.cluster.cli", "`pdserve.cluster` is banned"),
    ("pdserve/kernels", "import ray", "`ray` is banned"),
    ("pdserve/kernels", "from .. import workers", "TID252"),
])
def test_an_upward_import_fails_the_check(tree: Path, layer: str, source: str, says: str) -> None:
    planted = tree / layer / "planted.py"
    planted.write_text(f"{source}\n")
    run = _ruff(tree, ".")
    assert run.returncode == 1
    assert f"{layer}/planted.py:" in run.stdout and says in run.stdout, run.stdout + run.stderr


def test_the_layers_above_may_import_what_is_below(tree: Path) -> None:
    """The rule bans upward imports only: the same names pass where the layering allows them."""
    (tree / "cluster" / "planted.py").write_text(
        "import ray\nfrom fastapi import FastAPI\n\nfrom pdserve.cluster import cli\n"
        'from pdserve.workers import config\n\n__all__ = ["FastAPI", "cli", "config", "ray"]\n')
    (tree / "workers" / "planted.py").write_text(
        "from pdserve.kernels import attention\nfrom pdserve.workers import config\n\n"
        '__all__ = ["attention", "config"]\n')
    run = _ruff(tree, ".")
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("layer", LAYERS)
def test_a_layer_keeps_the_root_settings_and_bans(layer: str) -> None:
    """A nested banned-api table replaces the root's: each layer repeats the root's bans."""
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    nested = tomllib.loads((ROOT / layer / "ruff.toml").read_text())
    assert (ROOT / layer / nested["extend"]).resolve() == ROOT / "pyproject.toml"
    root_bans = root["flake8-tidy-imports"]["banned-api"]
    assert root_bans.items() <= nested["lint"]["flake8-tidy-imports"]["banned-api"].items()
