"""The ``agentspec`` command as a user runs it: a process of its own."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import agentspec

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_version_names_the_distribution_and_its_version():
    done = subprocess.run([sys.executable, "-m", "agentspec", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"agentspec-llm {agentspec.__version__}\n"


def test_the_installed_distribution_is_agentspec_llm_at_this_trees_version():
    """``make`` installs this tree as ``agentspec-llm``: its metadata, not a fallback, gives the version,
    and the ``agentspec`` command is its entry point."""
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["name"] == agentspec.DISTRIBUTION == "agentspec-llm"
    assert agentspec.__version__ == importlib.metadata.version("agentspec-llm") == project["version"]
    scripts = importlib.metadata.distribution("agentspec-llm").entry_points.select(group="console_scripts")
    assert [(script.name, script.value) for script in scripts] == [("agentspec", "agentspec.cli:main")]
