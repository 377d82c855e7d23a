"""The docs site builds with warnings as errors, and every Python snippet in it and in the README runs as written."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _snippets():
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
            line = text[:match.start()].count("\n") + 1
            yield pytest.param(page, match.group(1), id=f"{page.relative_to(ROOT)}:{line}")


@pytest.mark.parametrize("page,code", list(_snippets()))
def test_snippet_runs_as_written(tmp_path, monkeypatch, page, code):
    monkeypatch.chdir(tmp_path)  # logs and traces land here
    exec(compile(code, str(page), "exec"), {"__name__": "__snippet__"})


def _build(source, out):
    return subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(source),
                           str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_the_site_builds_strictly_and_a_broken_link_fails_it(tmp_path):
    built = _build(ROOT / "docs", tmp_path / "html")
    assert built.returncode == 0, built.stderr[-3000:]
    for page in ("index", "callbacks/nan-detector", "tags", "api", "how-it-works"):
        assert (tmp_path / "html" / f"{page}.html").exists(), page
    # the generated arguments: every constructor argument of a callback is on its page
    nan_page = (tmp_path / "html" / "callbacks" / "nan-detector.html").read_text()
    for argument in ("spike_zscore", "dead_after", "max_consecutive_skips", "repair"):
        assert argument in nan_page, argument
    # strict for real: the same docs with one link to a heading that does not exist do not build
    broken = tmp_path / "broken"
    shutil.copytree(ROOT / "docs", broken, ignore=shutil.ignore_patterns("_build"))
    with open(broken / "how-it-works.md", "a") as f:
        f.write("\nSee [the census](callbacks/precision-policy.md#no-such-heading).\n")
    failed = _build(broken, tmp_path / "broken_html")
    assert failed.returncode != 0
    assert "no-such-heading" in failed.stderr


def test_the_readme_stays_short_and_points_into_the_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert os.path.exists(ROOT / link), link


def test_every_argument_of_every_callback_is_documented():
    # the callback pages' Arguments sections are generated from these docstrings: an argument missing here is missing
    # there
    import inspect

    import lightning_opkit as opkit

    for cls in (opkit.PrecisionPolicy, opkit.NaNDetector, opkit.ProfilerWindows, opkit.TorchCompile,
                opkit.ActivationCheckpointing):
        documented = cls.__doc__[cls.__doc__.index("Args:"):]
        for name in inspect.signature(cls.__init__).parameters:
            if name != "self":
                assert re.search(rf"^\s+{name}( \(|:)", documented, re.M), f"{cls.__name__}({name}=...)"
