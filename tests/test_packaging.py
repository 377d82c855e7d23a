"""What the package declares is what was tested: the dependency ranges against docs/versions.md's runs, one version,
and a wheel that installs beside the torch a user already has."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import tomllib
import torch
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


_FIT = """
import lightning.pytorch as pl
import lightning_opkit
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning_opkit import ActivationCheckpointing, NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile

print("FROM", lightning_opkit.__file__)
callbacks = [PrecisionPolicy(measure=False), NaNDetector(), ProfilerWindows(every_n_steps=2, warmup=0, active=1),
             TorchCompile(backend="eager"), ActivationCheckpointing(modules=["layer"])]
trainer = pl.Trainer(max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     enable_checkpointing=False, callbacks=callbacks)
trainer.fit(BoringModel())
print("STEPS", trainer.global_step)
"""


def _run(*args, cwd):
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc.stdout


#: a Python whose environment holds a torch other than the pin's build (a CUDA wheel from PyPI, say): set
#: OPKIT_OTHER_TORCH_PYTHON, or keep one at /work/venvs/torch-*/bin/python as docs/versions.md describes
OTHER_TORCH = os.environ.get("OPKIT_OTHER_TORCH_PYTHON") or next(
    (str(p) for p in sorted(Path("/work/venvs").glob("torch-*/bin/python"))), None)


def _build(tmp_path) -> Path:
    dist = tmp_path / "dist"
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, ROOT, cwd=tmp_path)
    built = sorted(p.name for p in dist.iterdir())
    assert built == [f"lightning_opkit-{lightning_opkit.__version__}-py3-none-any.whl",
                     f"lightning_opkit-{lightning_opkit.__version__}.tar.gz"]
    assert "PASSED" in _run(sys.executable, "-m", "twine", "check", *dist.iterdir(), cwd=tmp_path)
    return dist


def _their_environment(tmp_path, site_packages: Path) -> tuple[Path, Path]:
    """A fresh venv that sees every package of ``site_packages`` but opkit (links, read through a .pth): the user's
    environment, untouched by the test; its python and its own site-packages."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for entry in site_packages.iterdir():
        if "opkit" not in entry.name:
            (theirs / entry.name).symlink_to(entry)
    venv_dir = tmp_path / "venv"
    _run(sys.executable, "-m", "venv", "--without-pip", venv_dir, cwd=tmp_path)
    python = venv_dir / "bin" / "python"
    site = Path(_run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", cwd=tmp_path).strip())
    (site / "theirs.pth").write_text(str(theirs) + "\n")
    return python, site


def _install_and_train(tmp_path, python: Path, site: Path, dist: Path, index: bool) -> list[str]:
    """Install the wheel with pip (``index``: missing dependencies from the registry; else none may be missing), torch
    the same before and after by pip's own report and freeze, then a 3-step fit with all five; what pip added."""
    pip = [python, "-m", "pip", "--disable-pip-version-check"]
    source = ["--find-links", dist] + ([] if index else ["--no-index"])
    freeze = [*pip, "freeze", "--all"]
    torch_before = [line for line in _run(*freeze, cwd=tmp_path).splitlines() if line.startswith("torch==")]
    assert len(torch_before) == 1
    report = tmp_path / "report.json"
    _run(*pip, "install", "--dry-run", *source, "--report", report, "lightning_opkit", cwd=tmp_path)
    would = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert "lightning_opkit" in would
    assert "torch" not in {name.lower() for name in would}  # pip keeps the torch that is there
    _run(*pip, "install", *source, "lightning_opkit", cwd=tmp_path)
    torch_after = [line for line in _run(*freeze, cwd=tmp_path).splitlines() if line.startswith("torch==")]
    assert torch_after == torch_before
    out = _run(python, "-c", _FIT, cwd=tmp_path)
    assert f"FROM {site}" in out  # the installed wheel, not this checkout
    assert "STEPS 3" in out
    return would


@pytest.mark.slow
def test_the_wheel_installs_beside_an_installed_torch_leaving_it_untouched_and_trains(tmp_path):
    """Built as a user's pip would get it (wheel and sdist, twine check), then installed into a fresh environment that
    already has a torch, lightning and the rest (this environment's, seen through a path file, less opkit itself):
    pip resolves with no index at all, so it can only keep what is there; torch is the same before and after, and a
    3-step fit with all five callbacks runs from the installed wheel."""
    dist = _build(tmp_path)
    here = Path(next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir()))
    python, site = _their_environment(tmp_path, here)
    assert _install_and_train(tmp_path, python, site, dist, index=False) == ["lightning_opkit"]


@pytest.mark.slow
@pytest.mark.skipif(OTHER_TORCH is None, reason="no environment with another torch here (OPKIT_OTHER_TORCH_PYTHON)")
def test_the_wheel_installs_beside_another_torch_build_leaving_it_untouched_and_trains(tmp_path):
    """The same, beside a torch other than the pin's (on this machine 2.14.1+cu130, PyPI's CUDA wheel): pip fetches
    what that environment lacks (lightning, tensorboard, ...) from the registry and leaves its torch as it is."""
    dist = _build(tmp_path)
    their_site = Path(_run(OTHER_TORCH, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                           cwd=tmp_path).strip())
    other = _run(OTHER_TORCH, "-c", "import torch; print(torch.__version__)", cwd=tmp_path).strip().splitlines()[-1]
    assert other != torch.__version__
    python, site = _their_environment(tmp_path, their_site)
    would = _install_and_train(tmp_path, python, site, dist, index=True)
    assert "lightning" in {name.lower() for name in would}  # it had no lightning: the registry's, beside its torch
