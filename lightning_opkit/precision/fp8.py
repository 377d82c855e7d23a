"""float8 GEMMs for the policy's ``"fp8"``: a module's ``forward`` patched in place to torchao's float8 matmul.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules for ``Float8Linear`` ones. The kit patches the
module's ``forward`` instead, so the module stays the same object: hooks (NaNDetector's, the policy's overrides),
TorchCompile's and ActivationCheckpointing's patches, the optimizer's parameters and ``state_dict`` keys are those of
the plain model, and teardown restores the forward. The GEMM is torchao's (``matmul_with_hp_or_float8_args``: dynamic
scaling, e4m3 forward, e5m2 gradients), the recipe one of its named ones (``"tensorwise"``, ``"rowwise"``).

Besides ``nn.Linear``, Hugging Face's ``Conv1D`` (GPT-2's projections: ``x @ weight + bias``, the weight stored
transposed) is taken too; torchao's conversion leaves those out.

A module torchao cannot take stays in the class's next dtype and is named once: a dimension not a multiple of 16
(float8 GEMMs need it), or a CUDA device without float8 Tensor Cores (compute capability below 8.9). On a CPU torch
runs float8 GEMMs without float8 units: they train (every test of the kit runs there), they are not faster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import logging
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from lightning_opkit.core.checks import check_bools, check_choice
from lightning_opkit.core.dtypes import autocast_off
from lightning_opkit.core.logging import markdown_table
from lightning_opkit.core.patch import Patches
from lightning_opkit.core.recompute import RECOMPUTING
from lightning_opkit.core.select import match_rule
from lightning_opkit.core.suspend import SUSPENDED
from lightning_opkit.core.text import named_reasons
from lightning_opkit.core.torch_compat import outside_dispatch_modes
from lightning_opkit.precision.decide import Decision
from lightning_opkit.precision.dtypes import FP8
from lightning_opkit.precision.fp8_gather import Float8AllGather, float8_weight, gather_lines, high_precision

__all__ = ["EXTRA", "FP8", "Float8Linears", "Fp8Recipe", "auto_candidates", "check_fp8", "fp8_lines", "fp8_markdown",
           "fp8_modules", "fp8_unit_note", "gemm_dims", "gemm_function", "recipe_problem", "require_torchao",
           "running_in", "torchao_missing", "torchao_problem"]

#: how a user gets torchao
EXTRA = "pip install 'lightning_opkit[fp8]'"
#: torchao's named recipes: one scale per tensor, or per row (finer, slower to scale)
Fp8Recipe = Literal["tensorwise", "rowwise"]
#: the dtype a Linear float8 cannot take runs in (the policy's :data:`~lightning_opkit.precision.dtypes.FP8_NEXT`)
FP8_NEXT_NAME = "bf16"
#: the dtype a census counts float8 GEMMs under
CENSUS_DTYPE = torch.float8_e4m3fn


def torchao_missing() -> bool:
    """Whether torchao is not installed here (nothing imported to tell)."""
    try:
        return importlib.util.find_spec("torchao") is None
    except ValueError:  # sys.modules["torchao"] is None: an import that must fail
        return True


class _Unactionable(logging.Filter):
    """Drops what importing torchao says that no user can act on.

    On a machine without CUDA, torchao's CUDA-only kernels (mxfp8, CUTLASS for sm90a) fail to load, each said as a
    warning; and a torch newer than torchao warns that torchao registers an Enum as a pytree constant.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        cuda_kernel = message.startswith("Failed to load") and not torch.cuda.is_available()
        return not (cuda_kernel or "is an Enum subclass and is now natively supported" in message)


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """Inside, torchao's and torch's pytree loggers drop :class:`_Unactionable` messages (the import only)."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    quiet = _Unactionable()
    for logger in loggers:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(quiet)


@functools.cache
def torchao_problem() -> str | None:
    """Why torchao's float8 training cannot be used here (not installed, or not importable with this torch), or None.

    Example:
        >>> torchao_problem() is None or "torchao" in torchao_problem()
        True
    """
    if torchao_missing():
        return f"torchao is not installed: {EXTRA}"
    try:
        with _quiet_import():
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args  # noqa: F401
    except Exception as err:  # a torchao built for another torch: its import fails on what this torch lacks
        from importlib.metadata import version

        return (f"torchao {version('torchao')} does not import with torch {torch.__version__}"
                f" ({type(err).__name__}: {str(err).splitlines()[0][:160]}); install a torchao built for it")
    return None


def require_torchao(owner: str, where: str) -> None:
    """Raise at construction when ``"fp8"`` is asked for without torchao, naming the extra that brings it.

    Args:
        owner: the callback, for the message.
        where: which argument asked for fp8.
    """
    problem = torchao_problem()
    if problem is not None:
        raise ImportError(f"{owner}({where}) runs float8 GEMMs through torchao: {problem}")


def check_fp8(rules: Any, overrides: Any, recipe: Any, try_fp8: Any = None, all_gather: Any = False) -> None:
    """Raise for a bad ``fp8_recipe``, ``try_fp8`` or ``fp8_all_gather``, or for float8 asked for without torchao.

    Example:
        >>> check_fp8({"matmul": "bf16"}, None, "columnwise")
        Traceback (most recent call last):
        ...
        ValueError: Expected `fp8_recipe` to be one of ['tensorwise', 'rowwise'], but got 'columnwise'
        >>> check_fp8({"matmul": "fp8"}, None, "rowwise", all_gather=True)
        Traceback (most recent call last):
        ...
        ValueError: Expected `fp8_recipe` to be 'tensorwise' with `fp8_all_gather=True`, but got 'rowwise'
    """
    check_choice("fp8_recipe", recipe, ["tensorwise", "rowwise"])
    check_choice("try_fp8", try_fp8, [None, True, False])
    check_bools(fp8_all_gather=all_gather)
    if all_gather and recipe != "tensorwise":  # torchao gathers a weight with one scale per tensor
        raise ValueError(f"Expected `fp8_recipe` to be 'tensorwise' with `fp8_all_gather=True`, but got {recipe!r}")
    for asked, where in ((try_fp8, "try_fp8=True"), (all_gather, "fp8_all_gather=True")):
        if asked:
            require_torchao("PrecisionPolicy", where)
    if isinstance(rules, dict) and rules.get("matmul") == FP8:
        require_torchao("PrecisionPolicy", "rules={'matmul': 'fp8'}")
    asked = [k for k, v in (overrides or {}).items() if v == FP8]
    if asked:
        require_torchao("PrecisionPolicy", f"overrides={{{asked[0]!r}: 'fp8'}}")


def fp8_modules(model: nn.Module, table: dict[str, str],
                overrides: dict[str, str]) -> dict[bool, list[tuple[str, nn.Module]]]:
    """The GEMM modules to run in float8, by whether a module override asked (else the matmul class rule).

    The innermost module with an override decides for a Linear (itself included), as for every other op; without
    one, the ``matmul`` rule.

    Example:
        >>> model = nn.Sequential(nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16)))
        >>> picked = fp8_modules(model, {"matmul": "fp8"}, {"1": "fp32"})
        >>> [n for n, _ in picked[False]], picked[True]
        (['0'], [])
    """
    picked: dict[bool, list[tuple[str, nn.Module]]] = {False: [], True: []}
    for name, module in model.named_modules():
        if gemm_dims(module) is None:
            continue
        rule = _override_of(name, overrides)
        if (rule if rule is not None else table.get("matmul")) == FP8:
            picked[rule is not None].append((name, module))
    return picked


def _override_of(name: str, overrides: dict[str, str]) -> str | None:
    """The dtype the innermost override at or above module ``name`` gives it (``None``: no override applies)."""
    parts = name.split(".")
    return next((r for i in range(len(parts), 0, -1)
                 if (r := match_rule(".".join(parts[:i]), overrides)) is not None), None) if overrides else None


def auto_candidates(model: nn.Module, fp8: Float8Linears, overrides: dict[str, str], try_fp8: bool | None,
                    device: torch.device) -> tuple[list[tuple[str, nn.Module]], str]:
    """The GEMM modules ``rules="auto"`` measures in float8, or why it tries none.

    Left to it: every Linear no override or pin decides and no rule already runs in float8. ``try_fp8=None`` tries
    where float8 can be fast (CUDA compute capability 8.9 or more); ``True`` on any device (a CPU measures it slower).

    Example:
        >>> model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
        >>> fp8 = Float8Linears("tensorwise", census=lambda: None)
        >>> [n for n, _ in auto_candidates(model, fp8, {"1": "fp32"}, True, torch.device("cpu"))[0]]
        ['0']
        >>> auto_candidates(model, fp8, {}, None, torch.device("cpu"))[1]
        'a CPU has no float8 GEMM units (torch runs them there, slower than bf16)'
    """
    if try_fp8 is False:
        return [], "try_fp8=False"
    note = torchao_problem() or ("" if try_fp8 else fp8_unit_note(device))
    if note:
        return [], note
    # a re-measurement decides again for the modules auto chose before
    picked = [(n, m) for n, m in model.named_modules() if gemm_dims(m) is not None
              and (n not in fp8.live or n in fp8.by_auto) and _override_of(n, overrides) is None]
    return picked, "" if picked else "every Linear is decided by an override, a pin or the rules"


def gemm_dims(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` features of a module fp8 can run (an ``nn.Linear`` or Hugging Face's ``Conv1D``), else ``None``.

    Example:
        >>> gemm_dims(nn.Linear(32, 48)), gemm_dims(nn.ReLU())
        ((32, 48), None)
    """
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and isinstance(getattr(module, "nf", None), int) and \
            isinstance(weight, Tensor) and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def fp8_unit_note(device: torch.device | str) -> str:
    """Why float8 GEMMs cannot be fast on ``device`` (``""`` where they can: CUDA compute capability 8.9 or more).

    Example:
        >>> fp8_unit_note("cpu")
        'a CPU has no float8 GEMM units (torch runs them there, slower than bf16)'
    """
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return "" if (major, minor) >= (8, 9) else f"no float8 Tensor Cores (compute capability {major}.{minor} < 8.9)"
    return f"a {device.type.upper()} has no float8 GEMM units (torch runs them there, slower than bf16)"


@functools.cache
def gemm_function(recipe: str) -> tuple[Any, Any, Any]:
    """The float8 matmul of torchao, its config for ``recipe``, and the GEMM configs it builds from that config.

    The inner dimension is padded to a multiple of 16 where it is not one: CUDA's ``_scaled_mm`` refuses it otherwise,
    and the weight gradient's GEMM has the rows of the batch as its inner dimension (a language model's ``batch x
    (seq - 1)`` tokens seldom are a multiple of 16). The zeros change no value; the copy costs memory only then.
    """
    torchao_problem()  # the first import of torchao, without its unactionable messages
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    with torch.device("meta"):  # only for torchao's GEMM configs, built from the recipe as it builds them
        mm_config = Float8Linear(16, 16, bias=False, config=config).linear_mm_config
    return matmul_with_hp_or_float8_args, config, mm_config


@functools.cache
def recipe_problem(recipe: str, device_type: str) -> str | None:
    """Why this torch runs no float8 GEMM of ``recipe`` on ``device_type``, or ``None``.

    One 16x16 GEMM and its backward, tried once per process. On a CPU, rowwise scaling needs torch 2.13 or later
    (2.11 runs per-tensor scales only there).
    """
    mm, config, mm_config = gemm_function(recipe)
    try:
        # values from a range, not the RNG: the probe must not move the run's random stream
        x = torch.linspace(-1, 1, 256, device=device_type).view(16, 16).requires_grad_()
        w = torch.linspace(1, -1, 256, device=device_type).view(16, 16).requires_grad_()
        with SUSPENDED.scope(), autocast_off():
            mm.apply(x, w.t(), mm_config, config).sum().backward()
    except Exception as err:  # the kernel this torch lacks for this recipe and device
        return (f"torch {torch.__version__} runs no {recipe} float8 GEMM on a {device_type.upper()}"
                f" ({str(err).splitlines()[0][:120]})")
    return None


_NOT_A_GEMM = "not a Linear"


def _written_otherwise(module: nn.Module) -> str | None:
    """Why patching ``module``'s forward would not run its GEMM, or would change what it computes; else ``None``.

    ``nn.MultiheadAttention`` reads its ``out_proj``'s weight itself and never calls that Linear's forward, so a
    patched forward would be reported and never run. A Linear subclass with a ``forward`` of its own computes more than
    its GEMM: replacing that forward would silently change the model.

    Example:
        >>> _written_otherwise(nn.MultiheadAttention(16, 2).out_proj)
        'nn.MultiheadAttention reads its weight directly: its forward never runs'
        >>> class Halved(nn.Linear):
        ...     def forward(self, x):
        ...         return super().forward(x) * 0.5
        >>> _written_otherwise(Halved(16, 16)), _written_otherwise(nn.Linear(16, 16))
        ('Halved has a forward of its own: kept as written', None)
    """
    if isinstance(module, nn.modules.linear.NonDynamicallyQuantizableLinear):
        return "nn.MultiheadAttention reads its weight directly: its forward never runs"
    if isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward:
        return f"{type(module).__name__} has a forward of its own: kept as written"
    return None


def refusal(module: nn.Module, device: torch.device) -> str | None:
    """Why ``module`` cannot run its GEMM in float8 here, or ``None`` if it can."""
    dims = gemm_dims(module)
    if dims is None:
        return _NOT_A_GEMM
    written = _written_otherwise(module)
    if written is not None:
        return written
    if any(d % 16 for d in dims):
        return f"{dims[0]}x{dims[1]}: float8 GEMMs need dimensions that are multiples of 16"
    return (fp8_unit_note(device) or None) if device.type == "cuda" else None


class Float8Linears:
    """The modules whose GEMM runs in float8, their patched forwards, and the ones left out (with why).

    Args:
        recipe: torchao's scaling recipe.
        census: returns the census of a census step (``None`` otherwise): fp8 calls are counted there, with their
            error against an fp32 recompute.
        all_gather: under FSDP2, gather the converted modules' weights in float8 (:mod:`.fp8_gather`; tensorwise).

    Example:
        >>> fp8 = Float8Linears("tensorwise", census=lambda: None)
        >>> model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 10))
        >>> fp8.convert(list(model.named_children()), torch.device("cpu"))
        >>> fp8.converted, fp8.skipped
        (['0'], {'1': '32x10: float8 GEMMs need dimensions that are multiples of 16'})
        >>> fp8.restore(); "forward" in vars(model[0])
        False
    """

    def __init__(self, recipe: Fp8Recipe, census: Callable[[], Any], all_gather: bool = False) -> None:
        self.recipe = recipe
        self.census = census
        self.all_gather = all_gather
        #: under FSDP2 with ``all_gather``: the modules whose weight is gathered in float8, and those left out
        self.gather = Float8AllGather()
        self._model: nn.Module | None = None
        #: the paths of the modules running float8 GEMMs (after teardown: those that ran them in the last fit)
        self.converted: list[str] = []
        #: module path -> why it was left in the class's next dtype
        self.skipped: dict[str, str] = {}
        #: the converted modules a module override asked for (the rest: the matmul class rule, or ``by_auto``)
        self.by_override: set[str] = set()
        #: the converted modules ``rules="auto"`` chose by measurement -> its decision (the evidence in ``reason``)
        self.by_auto: dict[str, Decision] = {}
        #: modules a repair reverted: no later choice runs them in float8 in this fit
        self.held: set[str] = set()
        self._live: dict[str, nn.Module] = {}
        self._patches: dict[str, Patches] = {}
        self._plain: set[nn.Module] = set()
        self._all_plain = 0
        #: where the modules run (set at setup)
        self.device = torch.device("cpu")

    def start(self, model: nn.Module, table: dict[str, str], overrides: dict[str, str], device: torch.device) -> None:
        """A fit's setup: forget the last fit, then run in float8 what rules and overrides ask (:func:`fp8_modules`).

        Args:
            model: the model.
            table: op class -> dtype name.
            overrides: module glob -> dtype name.
            device: where the model runs.
        """
        self.reset()
        self.device = device
        for by_override, modules in fp8_modules(model, table, overrides).items():
            self.convert(modules, device, by_override)
        slow = fp8_unit_note(device)  # on a GPU without float8 units no module was converted: no word needed
        if self.converted and slow:  # still possible, to test float8's numerics; said before step 1 with its cost
            rank_zero_warn(f"PrecisionPolicy: {len(self.converted)} Linear(s) run float8 GEMMs on {device.type}:"
                           f" {slow}; torch runs them with a reference kernel, about 1400x fp32's step time on an MLP"
                           " (docs/benchmarks.md, an Intel Xeon, 2026-12-06). Useful to test float8's numerics;"
                           " float8 is fast only on GPUs with float8 units (compute capability 8.9 or more).")

    def convert(self, modules: list[tuple[str, nn.Module]], device: torch.device, override: bool = False) -> None:
        """Run each of ``modules`` (path, module) that float8 can take in float8, until :meth:`restore`.

        Args:
            modules: ``(path, module)`` pairs; those that are not Linears are left out silently.
            device: where they run.
            override: whether a module override asked (else the class rule).
        """
        problem = recipe_problem(self.recipe, device.type) if modules else None
        for name, module in modules:
            if name in self._live:
                continue
            why = refusal(module, device) or problem
            if why == _NOT_A_GEMM:
                continue
            if why is not None:
                self.skipped[name] = why
                continue
            own = self._patches[name] = Patches()
            own.set(module, "forward", self._forward(name, module))
            if override:
                self.by_override.add(name)
            self._live[name] = module
            self.converted.append(name)

    def gather_weights(self, model: nn.Module, optimizers: list[torch.optim.Optimizer] | None = None) -> bool:
        """With ``all_gather``: from now on FSDP2 gathers each converted module's weight in float8; whether it asks.

        Args:
            model: the root module.
            optimizers: the fit's optimizers, at its start: each step drops the precomputed float8 scales.
        """
        if self.all_gather:
            self._model = model
            _, config, mm_config = gemm_function(self.recipe)
            self.gather.install(model, dict(self._live), mm_config, config)
            self.gather.watch(optimizers or [])
        return self.all_gather

    @property
    def live(self) -> list[str]:
        """The modules running float8 GEMMs now."""
        return list(self._live)

    def choose(self, chosen: dict[str, Decision], model: nn.Module, overrides: dict[str, str] | None = None) -> None:
        """``rules="auto"``'s float8 modules (path -> decision) from now on; those it no longer chose run as written.

        Args:
            chosen: the measured choice.
            model: the model the paths are in.
            overrides: the module overrides: a module one decides is not auto's (a checkpoint's choice, say, made
                under other overrides).
        """
        modules = dict(model.named_modules())
        missing = [n for n in chosen if n not in modules]
        if missing:  # a checkpoint of another model: refused before anything of it is applied
            raise ValueError(f"PrecisionPolicy: the decision runs {missing} in float8, but {type(model).__name__} has"
                             f" no such module (a checkpoint's 'plan.fp8' from another model?); its GEMM modules:"
                             f" {[n for n, m in modules.items() if gemm_dims(m) is not None][:8]}")
        chosen = {n: why for n, why in chosen.items() if _override_of(n, overrides or {}) is None}
        for name in [n for n in self.by_auto if n not in chosen]:
            self._drop(name)
        # a module a repair pinned stays pinned: a later plan (a trial's end, a resume) does not convert it again
        self.convert([(n, modules[n]) for n in chosen if n not in self._live and n not in self.held],
                     self.device)
        if self._model is not None:  # the fit has started: auto's modules are gathered in float8 like the rules'
            self.gather_weights(self._model)
        self.by_auto = {n: d for n, d in chosen.items() if n in self._live and n not in self.by_override}

    def revert(self, name: str) -> bool:
        """Run module ``name`` (a converted one) as written for the rest of the fit: a repair's pin. Whether it was."""
        if not self._drop(name):
            return False
        self.held.add(name)
        return True

    def _drop(self, name: str) -> bool:
        if self._live.pop(name, None) is None:
            return False
        self.gather.release(name)
        self._patches.pop(name).restore()
        self.converted.remove(name)
        self.by_auto.pop(name, None)
        return True

    def inside(self, module: nn.Module) -> list[str]:
        """The converted modules at or under ``module``."""
        within = {id(m) for m in module.modules()}
        return [n for n, m in self._live.items() if id(m) in within]

    @contextlib.contextmanager
    def plain(self, module: nn.Module | None) -> Iterator[None]:
        """Inside, the converted modules at or under ``module`` (``None``: all) run as written: a replay's dtypes.

        With ``module=None`` (a measurement) FSDP2 gathers their weights as written too, not in float8.
        """
        if module is None:
            # a measurement's fp32 baseline with the weights FSDP2 would gather in float8 gathered as they are
            aside = [n for n in self.gather.live if self.gather.release(n, forget=False)] if not self._all_plain else []
            self._all_plain += 1
            try:
                yield
            finally:
                self._all_plain -= 1
                if aside and self._model is not None:
                    self.gather_weights(self._model)
            return
        added = {self._live[n] for n in self.inside(module)} - self._plain
        self._plain |= added
        try:
            yield
        finally:
            self._plain -= added

    def restore(self) -> None:
        """Every converted module runs as written again (teardown, an exception); what ran stays readable."""
        self.gather.restore()
        self._model = None
        for own in self._patches.values():
            own.restore()
        self._live.clear()
        self._patches.clear()
        self._plain.clear()

    def reset(self) -> None:
        """Restore, and forget what ran (a new setup decides again)."""
        self.restore()
        self.converted.clear()
        self.by_override.clear()
        self.by_auto.clear()
        self.held.clear()
        self.skipped.clear()
        self.gather.reset()

    def _forward(self, name: str, gemm: nn.Module) -> Callable[..., Tensor]:
        mm, config, mm_config = gemm_function(self.recipe)
        module: Any = gemm  # an nn.Linear or a Conv1D: a weight and a bias
        transposed = isinstance(module, nn.Linear)  # Conv1D stores (in, out): already the GEMM's right operand
        plain_forward = type(module).forward.__get__(module)

        def forward(input: Tensor) -> Tensor:
            if self._all_plain or module in self._plain:
                if not float8_weight(module.weight):
                    return plain_forward(input)
                # FSDP2 gathered the weight in float8: as written, but with that weight in its own dtype
                weight = high_precision(module.weight)
                return F.linear(input, weight if transposed else weight.t(), module.bias)
            device = input.device.type
            if torch.is_autocast_enabled(device):
                input = input.to(torch.get_autocast_dtype(device))  # as autocast would hand a GEMM its input
            weight = module.weight.t() if transposed else module.weight
            # the policy's mode stands aside: torchao's scaling ops are not the model's ops to cast
            with SUSPENDED.scope(), autocast_off():
                out = mm.apply(input, weight, mm_config, config)
                if module.bias is not None:
                    out = out + module.bias.to(out.dtype)
            census = self.census()
            if census is not None and not RECOMPUTING.depth:  # an activation checkpoint's recompute: counted once
                # the fp32 reference is bookkeeping: no autograd graph (an activation checkpoint would count what it
                # saves, and its recompute runs without the census), no cast of the policy's, no dispatch mode's cache
                with torch.no_grad(), SUSPENDED.scope(), autocast_off(), outside_dispatch_modes():
                    high = high_precision(module.weight)
                    ref = F.linear(input.float(), (high if transposed else high.t()).float(),
                                   None if module.bias is None else module.bias.float())
                census.record_as("matmul", CENSUS_DTYPE, out, name in self.by_override, ref)
            return out

        return forward


@contextlib.contextmanager
def running_in(fp8: Float8Linears, governor: Any, module: nn.Module | None, dtype: str) -> Iterator[None]:
    """Inside, every op in ``module`` (``None``: the whole step) runs in ``dtype``, its float8 GEMMs included.

    Args:
        fp8: the policy's float8 modules (those at or under ``module`` run as written inside).
        governor: the policy's :class:`~lightning_opkit.precision.governor.StepGovernor`.
        module: the module, or ``None``.
        dtype: the dtype name.
    """
    with fp8.plain(module), governor.running_in(module, dtype):
        yield


def fp8_lines(fp8: Float8Linears, auto: list[str] | None = None) -> list[str]:
    r"""The run summary's float8 lines: what rules and overrides run in float8, what could not and why; then ``auto``'s.

    Args:
        fp8: the policy's float8 modules.
        auto: ``rules="auto"``'s lines (what it measured and chose, or why it tried nothing).

    Example:
        >>> fp8 = Float8Linears("tensorwise", census=lambda: None)
        >>> fp8.convert([("0", nn.Linear(32, 32)), ("1", nn.Linear(32, 10))], torch.device("cpu"))
        >>> for line in fp8_lines(fp8):
        ...     print(line)
          fp8: 1 GEMM module(s) in float8 (tensorwise scaling, torchao)
          fp8: left in bf16: 1 (32x10: float8 GEMMs need dimensions that are multiples of 16)
    """
    lines = []
    ruled = [n for n in fp8.converted if n not in fp8.by_auto]
    if ruled:
        lines.append(f"  fp8: {len(ruled)} GEMM module(s) in float8 ({fp8.recipe} scaling, torchao)")
    if fp8.skipped:
        lines.append(f"  fp8: left in {FP8_NEXT_NAME}: {named_reasons(fp8.skipped)}")
    if fp8.all_gather:
        lines += gather_lines(fp8.gather)
    if fp8.by_auto and not auto:  # a decision a checkpoint brought: nothing measured in this fit
        name, decided = next(iter(fp8.by_auto.items()))
        lines.append(f"  fp8: {len(fp8.by_auto)} GEMM module(s) in float8 by rules='auto', e.g. {name}"
                     f" ({decided.reason})")
    return lines + (auto or [])


def fp8_markdown(fp8: Float8Linears) -> str:
    """The float8 section of ``opkit/precision/policy``: each module in float8 or left out, and why (``""``: none).

    Example:
        >>> fp8 = Float8Linears("rowwise", census=lambda: None)
        >>> fp8.convert([("head", nn.Linear(32, 3))], torch.device("cpu"))
        >>> print(fp8_markdown(fp8))
        <BLANKLINE>
        <BLANKLINE>
        **float8 GEMMs** (rowwise scaling, torchao):
        <BLANKLINE>
        | module | runs in | why |
        |---|---|---|
        | head | bf16 | 32x3: float8 GEMMs need dimensions that are multiples of 16 |
    """
    if not (fp8.converted or fp8.skipped):
        return ""
    gathered = {n: "; its weight gathered in float8 (FSDP2)" for n in fp8.gather.gathered}
    gathered.update({n: f"; its weight gathered in its own dtype ({why})" for n, why in fp8.gather.skipped.items()})
    rows = [[n, "fp8", ("module override" if n in fp8.by_override else f"rules='auto': {fp8.by_auto[n].reason}"
                        if n in fp8.by_auto else "matmul rule") + gathered.get(n, "")] for n in fp8.converted]
    rows += [[n, FP8_NEXT_NAME, why] for n, why in fp8.skipped.items()]
    return (f"\n\n**float8 GEMMs** ({fp8.recipe} scaling, torchao):\n\n"
            + markdown_table(["module", "runs in", "why"], rows))
