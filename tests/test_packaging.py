"""What the package declares is what was tested: the dependency ranges against docs/versions.md's runs, one version."""

from __future__ import annotations

import re
from importlib.metadata import version
from pathlib import Path

import tomllib
from helpers import ROOT as _ROOT
from packaging.requirements import Requirement
from packaging.version import Version

import lightning_opkit

ROOT = Path(_ROOT)


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return {Requirement(r).name: Requirement(r) for r in reqs}


def test_the_torch_range_holds_every_version_the_suite_ran_on_and_no_later_minor():
    ran = sorted({Version(v) for v in re.findall(r"^\| (\d+\.\d+\.\d+)", (ROOT / "docs/versions.md").read_text(),
                                                  re.M)})
    assert len(ran) >= 4  # 2.9 to 2.15, as the page's table lists them
    torch = _requirements()["torch"].specifier
    assert all(v in torch for v in ran), (torch, ran)
    newest = ran[-1]
    assert Version(f"{newest.major}.{newest.minor + 1}.0") not in torch  # never run: not promised
    assert Version(f"{ran[0].major}.{ran[0].minor - 1}.0") not in torch
    assert f"torch {ran[0].major}.{ran[0].minor} to {newest.major}.{newest.minor}" in (ROOT / "README.md").read_text()


def test_every_other_range_holds_the_pinned_version_and_names_an_upper_bound():
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^\s#]+)", (ROOT / "constraints.txt").read_text(), re.M))
    for name in ("lightning", "transformers", "torchao"):
        spec = _requirements()[name].specifier
        assert Version(pins[name]) in spec, (name, spec)
        assert any(s.operator == "<" for s in spec), f"{name}: no upper bound, yet only {spec} was tested"


def test_the_version_is_one_number():
    """pyproject.toml takes it from ``__version__``; the installed metadata says the same."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lightning_opkit.__version__"}
    assert lightning_opkit.__version__ == version("lightning_opkit")
