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


def _yaml_snippets():
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"^```yaml\n(.*?)^```", text, re.S | re.M):
            line = text[:match.start()].count("\n") + 1
            yield pytest.param(match.group(1), id=f"{page.relative_to(ROOT)}:{line}")


def test_every_callback_page_shows_a_config():
    for page in sorted((ROOT / "docs" / "callbacks").glob("*.md")):
        assert "```yaml\n" in page.read_text(), page.name


@pytest.mark.parametrize("config", list(_yaml_snippets()))
def test_yaml_snippet_parses_in_lightningcli_as_written(tmp_path, config):
    import warnings

    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_opkit import OpkitDeprecationWarning

    path = tmp_path / "config.yaml"
    path.write_text(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cli = LightningCLI(BoringModel, run=False, save_config_callback=None, args=["--config", str(path)])
    deprecated = [str(w.message) for w in caught if issubclass(w.category, OpkitDeprecationWarning)]
    assert bool(deprecated) == ("# warns" in config), deprecated  # only a snippet that says so uses an old name
    named = re.findall(r"class_path: lightning_opkit\.(\w+)", config)
    built = [type(c).__name__ for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_opkit")]
    assert built == named


def test_the_start_page_carries_the_readme_overview():
    index = (ROOT / "docs" / "index.md").read_text()
    for name in ("PrecisionPolicy", "NaNDetector", "ProfilerWindows", "TorchCompile", "ActivationCheckpointing"):
        assert f"| `{name}` |" in index, name


def test_each_callback_page_has_its_arguments_table_as_generated_now():
    from lightning_opkit.arguments import render_pages

    pages = render_pages(str(ROOT / "docs" / "callbacks"))
    assert len(pages) == 5
    for path, text in pages.items():
        assert pathlib.Path(path).read_text() == text, f"{path} is stale: make docs-args"
        assert "| `enabled` | `bool` | `True` |" in text  # a table a reader on GitHub sees, not a directive
