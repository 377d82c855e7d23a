"""The package's shape, checked: folders per callback over a core that imports no feature, small parts, public paths
and files written by the flat 0.1 layout still loading."""

import ast
import os
import pathlib
import pickle

import pytest
import torch

import lightning_opkit
from lightning_opkit import OpkitDeprecationWarning

PACKAGE = pathlib.Path(lightning_opkit.__file__).parent
FEATURES = {"nan": "detector.py", "profiler": "windows.py", "compile": "torch_compile.py", "precision": "policy.py",
            "checkpointing": "activation_checkpointing.py"}
DATA = pathlib.Path(__file__).parent / "data"


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text())


def _imported(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_opkit."):
            yield node.module.split(".")[1]


def test_the_top_level_holds_folders_the_taxonomy_and_the_public_names():
    top = {p.name for p in PACKAGE.iterdir() if p.name != "__pycache__"}
    # arguments.py makes the docs pages' Arguments tables from every callback, so it sits above them
    assert top == {"__init__.py", "opclass.py", "arguments.py", "py.typed", "core", *FEATURES}
    assert not [p for p in PACKAGE.rglob("_*.py") if p.name != "__init__.py"]  # no prefix stands in for a folder


def test_core_imports_no_feature_and_no_feature_imports_another():
    for path, tree in _modules():
        area = path.relative_to(PACKAGE).parts[0]
        allowed = {"core", "opclass"} | ({area} if area in FEATURES else set())
        if area in ("__init__.py", "opclass.py"):
            continue
        assert set(_imported(tree)) <= allowed, (path, set(_imported(tree)) - allowed)


def test_only_the_file_named_after_the_callback_is_lightning_facing():
    for path, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") in ("OpkitCallback", "Callback")
                                                      for b in node.bases):
                area, name = path.relative_to(PACKAGE).parts[0], path.name
                if (area, name, node.name) == ("core", "callback.py", "OpkitCallback"):
                    continue  # their shared base
                assert FEATURES.get(area) == name, f"{path}: {node.name} is a callback outside {FEATURES.get(area)}"


def _code_lines(lines, node):
    docstrings = set()
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and body and isinstance(body[0], ast.Expr) and \
                isinstance(getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    return sum(1 for i in range(node.lineno, node.end_lineno + 1)
               if i not in docstrings and lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))


def test_no_class_over_250_code_lines_nor_function_over_60():
    for path, tree in _modules():
        lines = path.read_text().splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                assert _code_lines(lines, node) <= 250, f"{path}: class {node.name}"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert _code_lines(lines, node) <= 60, f"{path}: {node.name}"


def _functions_taking_a_callback(tree, callbacks):
    """Module-level functions with a parameter annotated as one of the callbacks (their internals moved out)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for arg in node.args.args + node.args.kwonlyargs:
                if arg.annotation is not None and {n.id for n in ast.walk(arg.annotation)
                                                   if isinstance(n, ast.Name)} & callbacks:
                    yield f"{node.name}({arg.arg})"


def test_no_class_needs_module_functions_that_take_it_nor_reads_another_s_privates():
    callbacks = set(lightning_opkit.__all__) & {"NaNDetector", "PrecisionPolicy", "ProfilerWindows", "TorchCompile",
                                                "ActivationCheckpointing"}
    assert len(callbacks) == 5
    names = {"detector", "policy", "windows", "compiler", "checkpointing", "callback"}
    for path, tree in _modules():
        assert not list(_functions_taking_a_callback(tree, callbacks)), path
        # a callback's private state is its own: no `detector._x` outside its class
        reads = [f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute) and
                 isinstance(n.value, ast.Name) and n.value.id in names and n.attr.startswith("_")]
        assert not reads, (path, reads)
    # the check sees what it is for
    planted = ast.parse("def _settle(detector: NaNDetector, trainer) -> None:\n    detector._late = None\n")
    assert list(_functions_taking_a_callback(planted, callbacks)) == ["_settle(detector)"]


def test_public_import_paths_stay():
    from lightning_opkit.compile import TorchCompile
    from lightning_opkit.nan import NaNDetector, NonFiniteError
    from lightning_opkit.precision import PrecisionPolicy, decide, measure_precision
    from lightning_opkit.profiler import ProfilerWindows

    assert lightning_opkit.TorchCompile is TorchCompile
    assert lightning_opkit.NaNDetector is NaNDetector
    assert lightning_opkit.NonFiniteError is NonFiniteError
    assert lightning_opkit.PrecisionPolicy is PrecisionPolicy
    assert lightning_opkit.ProfilerWindows is ProfilerWindows
    assert lightning_opkit.decide is decide
    assert lightning_opkit.measure_precision is measure_precision
    assert set(lightning_opkit.__all__) <= set(dir(lightning_opkit))


def test_non_finite_error_pickles_under_its_public_path():
    from lightning_opkit import NonFiniteError

    report = {"step": 3, "phase": "loss", "module": "", "module_type": "Net", "nan": 1, "inf": 0}
    data = pickle.dumps(NonFiniteError(report, reason="lead."))
    assert b"lightning_opkit\nNonFiniteError" in data or b"lightning_opkit\x94\x8c\x0eNonFiniteError" in data
    assert b"lightning_opkit.nan" not in data
    again = pickle.loads(data)
    assert again.report == NonFiniteError(report).report


def test_a_checkpoint_written_by_the_flat_layout_resumes(tmp_path):
    """tests/data/v0.1.ckpt: written by lightning_opkit 0.1 (flat modules) with every callback's state in it."""
    from helpers import TinyNet, make_loader, trainer

    from lightning_opkit import NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile

    detector = NaNDetector(action="skip", every_n_steps=1)
    windows = ProfilerWindows(every_n_steps=3, warmup=0, active=1, export_trace=False)
    callbacks = [PrecisionPolicy(rules={"norm": "fp32"}, overrides={"head": "fp32"}, census_every_n_steps=2), detector,
                 windows, TorchCompile(backend="eager", modules=["body"])]
    t = trainer(tmp_path, callbacks, max_steps=7, max_epochs=3)
    t.fit(TinyNet(), make_loader(), ckpt_path=str(DATA / "v0.1.ckpt"))
    assert t.global_step == 7
    assert [(e["step"], e["module"], e["cause"]) for e in detector.events] == [(2, "body.1", "data_or_model")]
    assert detector.skipped_steps == 1
    # resumed from 1 window and 5 batches: the schedule went on (a window at batch 6), not from the start
    assert windows.batches_seen == 7
    assert windows.windows_done == 2


def test_a_config_written_for_the_flat_layout_parses_and_builds_every_callback():
    from lightning.pytorch.cli import LightningCLI

    from examples.vit import DigitsDataModule, ViTClassifier

    with pytest.warns(OpkitDeprecationWarning, match=r"PrecisionPolicy\(modules=\.\.\.\).*use overrides="):
        cli = LightningCLI(ViTClassifier, DigitsDataModule, run=False, save_config_callback=None,
                           args=["--config", str(DATA / "v0.1_config.yaml")])
    names = [type(c).__name__ for c in cli.trainer.callbacks if type(c).__module__.startswith("lightning_opkit")]
    assert names == ["PrecisionPolicy", "NaNDetector", "ProfilerWindows", "TorchCompile", "NaNDetector"]
    policy = cli.trainer.callbacks[0]
    assert policy.overrides == {"model.head": "fp32"}
    assert policy.table["matmul"] == "bf16"


@pytest.mark.parametrize("path", ["lightning_opkit.nan.NaNDetector", "lightning_opkit.profiler.ProfilerWindows",
                                  "lightning_opkit.compile.TorchCompile", "lightning_opkit.precision.PrecisionPolicy"])
def test_class_paths_of_each_folder_resolve(path):
    module, _, name = path.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is getattr(lightning_opkit, name)


def test_checkpoint_fixture_is_the_flat_layouts():
    state = torch.load(DATA / "v0.1.ckpt", weights_only=False)["callbacks"]
    assert any(key.startswith("NaNDetector") for key in state)
    assert os.path.getsize(DATA / "v0.1.ckpt") < 64_000


#: the most files a skipped non-finite step may run functions in (issue 52; docs/architecture.md lists them)
NAN_PATH_FILES = 12


def test_the_nan_path_in_the_architecture_page_is_the_path_a_skipped_step_takes(tmp_path):
    import json
    import re
    import subprocess
    import sys

    script = pathlib.Path(__file__).parent / "nan_path_script.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traced = json.loads(proc.stdout.strip().splitlines()[-1])
    assert traced["skipped"] == 1  # the step was bad
    assert traced["calls"] > 100  # and the tracer saw it handled
    page = (pathlib.Path(__file__).parent.parent / "docs" / "architecture.md").read_text()
    section = page.split("## One NaN, from the hook to the tag")[1].split("\n## ")[0]
    listed = re.findall(r"^\d+\. `([\w/]+\.py)`", section, flags=re.M)
    assert listed == traced["files"]  # the page is the code's path, in the order each file is first entered
    assert f"runs functions in these {len(listed)}" in section
    assert len(listed) <= NAN_PATH_FILES


#: the suite's files that test a scenario across the package rather than one module, each named for its scenario
SCENARIOS = {"test_benchmarks", "test_contract", "test_ddp", "test_docs", "test_example", "test_garbage",
             "test_gpu_paths", "test_layout", "test_moe", "test_packaging", "test_readme", "test_regressions",
             "test_sharded", "test_zoo", "test_matrix"}


def _unnamed_tests():
    """Test files not importing the module they are named for (tests/<area>/test_<m>.py: lightning_opkit.<area>.<m>)."""
    tests = pathlib.Path(__file__).parent
    for path in sorted(tests.rglob("test_*.py")):
        parts = path.relative_to(tests).parts
        if parts[0] in ("zoo", "matrix") or (len(parts) == 1 and path.stem in SCENARIOS) or \
                (parts[0] == "matrix" and path.stem in SCENARIOS):
            continue
        target = ".".join(["lightning_opkit", *parts[:-1], path.stem.removeprefix("test_")])
        froms = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom) and n.module]
        imported = {n.module for n in froms} | {f"{n.module}.{a.name}" for n in froms for a in n.names}
        if not any(m == target or m.startswith(target + ".") for m in imported):
            yield str(path.relative_to(tests))


def test_every_module_has_its_test_file():
    """Issue 52: each module under lightning_opkit/ has tests/<area>/test_<module>.py (which, by the test below,
    imports it)."""
    tests = pathlib.Path(__file__).parent
    without = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "__init__.py":
            continue
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if not (tests.joinpath(*parts[:-1]) / f"test_{parts[-1]}.py").exists():
            without.append(".".join(parts))
    assert without == [], f"modules with no test file of their own: {without}"


#: what in a test fits or runs a Trainer, or a whole program: a helper's ``trainer(``, ``.fit(``, the CLI, a process
RUNS_A_TRAINER = ("trainer(", ".fit(", "LightningCLI", "run_cli", "subprocess")


def _tests_without_a_fit(path: pathlib.Path) -> list[str]:
    """The test functions of ``path`` that fit no Trainer, neither themselves nor through a helper of the same file."""
    source = path.read_text()
    defs = {n.name: n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    fitting = {name for name, node in defs.items()
               if any(k in ast.get_source_segment(source, node) for k in RUNS_A_TRAINER)}
    grown = True
    while grown:  # a helper that calls a fitting helper fits too
        grown = False
        for name, node in defs.items():
            if name not in fitting and any(isinstance(n, ast.Name) and n.id in fitting for n in ast.walk(node)):
                fitting.add(name)
                grown = True
    return [name for name in defs if name.startswith("test") and name not in fitting]


def test_each_trainer_free_module_has_a_test_that_fits_no_trainer():
    """Issue 52: a module that imports nothing of Lightning is tested without fitting a Trainer, at least once, in
    its own test file (a Trainer built only to hand a LogWriter its logger, never fitted, counts as none)."""
    fitted_only = []
    for path, tree in _modules():
        modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)] + [
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        if path.name == "__init__.py" or any(m.split(".")[0] == "lightning" for m in modules):
            continue
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        test_file = pathlib.Path(__file__).parent.joinpath(*parts[:-1]) / f"test_{parts[-1]}.py"
        if not _tests_without_a_fit(test_file):
            fitted_only.append(".".join(parts))
    assert fitted_only == [], f"Trainer-free modules tested only by fitting a Trainer: {fitted_only}"


def test_the_tests_mirror_the_package_and_each_file_imports_the_module_it_is_named_for():
    tests = pathlib.Path(__file__).parent
    areas = {p.name for p in tests.iterdir() if p.is_dir() and (p / "__init__.py").exists() and p.name != "zoo"}
    assert areas == set(FEATURES) | {"core"}
    assert not list(_unnamed_tests())
    # nothing at the top but scenarios and the top-level modules' own
    top = {p.stem for p in tests.glob("test_*.py")}
    assert top - SCENARIOS == {f"test_{p.stem}" for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, read from the source (``TYPE_CHECKING`` and function-level imports
    included: a circle a type checker or a lazy import walks is still a circle to the reader)."""
    trees = {}
    for path, tree in _modules():
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        trees[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = tree
    names = set(trees)
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        edges = set()
        for node in ast.walk(tree):
            module = node.module if isinstance(node, ast.ImportFrom) and not node.level else None
            if module and module.startswith("lightning_opkit"):
                for alias in node.names:
                    sub = f"{module}.{alias.name}"
                    edges.add(sub if sub in names else module)
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in names)
        graph[name] = {e for e in edges if e in names and e != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the path that closes it."""
    found, done = [], set()

    def visit(node, path):
        if node in path:
            found.append(path[path.index(node):] + [node])
            return
        if node in done:
            return
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        done.add(node)

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_module_of_the_package_imports_itself_through_others():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]  # the finder finds
    graph = _import_graph()
    assert "lightning_opkit.nan.report" in graph["lightning_opkit.nan.actions"]  # and the graph is the code's
    assert _circles(graph) == []


#: where other libraries' private names may be read: one adapter per library, each with its test file
COMPAT = {"core/torch_compat.py", "core/dynamo_compat.py", "core/fsdp.py", "core/torchao_compat.py",
          "core/lightning_compat.py"}
#: the libraries opkit builds on, whose private names must stay behind an adapter
FOREIGN = ("torch", "torchao", "lightning", "torchmetrics", "tensorboard", "numpy", "jsonargparse")
#: Lightning documents ``Callback._generate_state_key`` as the way a subclass builds its ``state_key``
DOCUMENTED_PROTECTED = {"_generate_state_key"}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(trees) -> set[str]:
    """Every name opkit defines itself: functions, classes, variables, arguments, attributes set on self or a class."""
    own: set[str] = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.arg):
                own.add(n.arg)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and \
                    isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                own.add(n.attr)
            elif isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "__slots__":
                own.update(e.value for e in n.value.elts if isinstance(e, ast.Constant))
    return own


def _foreign_privates(tree: ast.AST, own: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` of each private name of another library the module imports, reads or sets."""
    found = []
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            found += [(n.lineno, a.name) for a in n.names
                      if a.name.split(".")[0] in FOREIGN and any(map(_private, a.name.split(".")))]
        elif isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] in FOREIGN:
            if any(map(_private, n.module.split("."))) or any(_private(a.name) for a in n.names):
                found.append((n.lineno, n.module))
        elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own | DOCUMENTED_PROTECTED:
            found.append((n.lineno, n.attr))
        elif isinstance(n, ast.Call) and getattr(n.func, "id", "") in ("getattr", "hasattr", "setattr") and \
                len(n.args) > 1 and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str) and \
                _private(n.args[1].value) and n.args[1].value not in own:
            found.append((n.lineno, n.args[1].value))
    return found


def test_other_libraries_private_names_are_read_only_in_their_adapters():
    """Issue 52: torch's, dynamo's, FSDP2's, torchao's, Lightning's private names, read from the code: each behind
    the adapter whose test uses it on the running release, so a release that moves one is mended in one place."""
    modules = {str(path.relative_to(PACKAGE)): tree for path, tree in _modules()}
    own = _own_names(modules.values())
    leaks = {rel: _foreign_privates(tree, own) for rel, tree in modules.items() if rel not in COMPAT}
    assert {rel: found for rel, found in leaks.items() if found} == {}
    for rel in COMPAT:  # each adapter has its test file, and is one
        assert _foreign_privates(modules[rel], own), rel
        assert (pathlib.Path(__file__).parent / "core" / f"test_{pathlib.Path(rel).stem}.py").exists(), rel
    # the check sees what it is for: a private module, a private attribute, a private name read by string
    planted = ast.parse("import torch._dynamo\nfrom torch.utils._pytree import tree_map\n"
                        "x = torch.autograd.profiler._is_profiler_enabled\ny = getattr(opt, '_step_supports_amp')\n"
                        "z = self._mine\n")
    assert [name for _, name in _foreign_privates(planted, {"_mine"})] == [
        "torch._dynamo", "torch.utils._pytree", "_is_profiler_enabled", "_step_supports_amp"]
