"""The ``jspec`` command line imports only what the distribution installs.

Each command's ``--help`` runs in a subprocess from an empty directory, so a command that
imports an unpackaged module (``bench``, ``tests``, ``examples``) fails here with
``ModuleNotFoundError`` instead of only outside a checkout.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from jspec import cli

REPO = Path(__file__).resolve().parents[1]
DIST = "jspec-jax"
_CMDS = [[], *([name] for name in cli.COMMANDS)]


def _packaged_top_levels() -> list[str]:
    """Top-level packages the wheel holds (pyproject's ``packages.find`` include patterns)."""
    cfg = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = cfg["tool"]["setuptools"]["packages"]["find"]["include"]
    return sorted(
        p.name
        for p in REPO.iterdir()
        if (p / "__init__.py").is_file() and any(fnmatch(p.name, pat) for pat in patterns)
    )


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def packaged_only(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """An empty cwd and an env whose path holds only this checkout's packaged top levels."""
    root = tmp_path_factory.mktemp("cli")
    site, cwd = root / "site", root / "cwd"
    site.mkdir()
    cwd.mkdir()
    for name in _packaged_top_levels():
        (site / name).symlink_to(REPO / name, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(site), "JAX_PLATFORMS": "cpu"}
    probe = _run(
        [
            sys.executable,
            "-c",
            "import importlib.util as u; "
            "print([m for m in ('bench', 'tests', 'examples') if u.find_spec(m)])",
        ],
        cwd,
        env,
    )
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", (
        f"unpackaged modules importable from a clean directory, the test proves nothing: "
        f"{probe.stdout}{probe.stderr}"
    )
    return cwd, env


def test_packaged_top_levels() -> None:
    assert _packaged_top_levels() == ["interop", "jspec"]


@pytest.mark.parametrize("cmd", _CMDS, ids=lambda c: " ".join(c) or "jspec")
def test_help_from_packaged_modules_only(cmd: list[str], packaged_only) -> None:
    cwd, env = packaged_only
    out = _run([sys.executable, "-m", "jspec.cli", *cmd, "--help"], cwd, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "usage" in out.stdout.lower() or "jspec" in out.stdout, out.stdout


@pytest.mark.parametrize("cmd", _CMDS, ids=lambda c: " ".join(c) or "jspec")
def test_installed_console_script(cmd: list[str], tmp_path: Path) -> None:
    """``jspec CMD --help`` through the installed entry point (``make test``'s venv)."""
    try:
        importlib.metadata.distribution(DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"distribution {DIST} not installed in this interpreter")
    script = Path(sys.executable).parent / "jspec"
    if not script.is_file():
        pytest.skip(f"no console script beside {sys.executable}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = _run([str(script), *cmd, "--help"], tmp_path, {**env, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stdout + out.stderr


def test_unknown_command_and_bare_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench"]) == 2
    assert "unknown command 'bench'" in capsys.readouterr().err
    assert cli.main([]) == 2
    assert "usage: jspec {" + ",".join(cli.COMMANDS) + "}" in capsys.readouterr().out
