"""One compiled region at run time, Trainer-free: the forward that replaces the module's, and what it accounts.

Per call: a profiler span named after the region, the compiled code (eagerly with ``eager_on_recompile`` once the
region neared dynamo's recompile limit), eager fallback on a compile failure, recompiles counted against the region,
and once, if asked, eager against compiled time (:func:`speed_trial`: on the region's own calls, no extra ones).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lightning_opkit.compile.regions import Region
from lightning_opkit.compile.watch import DynamoWatch, expected_recompile
from lightning_opkit.core.dynamo_compat import COMPILE_FAILURES, cache_entries, recompile_limit, stance
from lightning_opkit.core.facts import FASTER
from lightning_opkit.core.recompute import RECOMPUTING
from lightning_opkit.core.torch_compat import profiler_enabled
from lightning_opkit.core.trial import Trial

__all__ = ["CompiledForward", "RegionHooks", "limit_message", "shared_trials", "speed_trial"]


def speed_trial(regions: int = 1) -> Trial:
    """Eager against compiled time on a region's own calls: no extra call, so nothing runs twice.

    After two warm-up calls the next six take turns (C E E C C E), each timed on the device's clock; the speedup is
    eager's median over compiled's (:meth:`~lightning_opkit.core.trial.Trial.ratio`). Replays and census steps (a
    forced eager stance) are not the region's training calls and do not count. Identical regions (blocks sharing
    their compiled code and their parameters' shapes) share one trial, ``regions`` times as long, and one verdict:
    three calls of each, judged apart, gave four identical blocks 1.47x, 1.03x, 0.86x and 1.11x in one run.

    Args:
        regions: how many identical regions take their calls from it.

    Example:
        >>> trial = speed_trial()
        >>> [trial.next() for _ in range(4)]
        ['warmup', 'warmup', 'compiled', 'eager']
    """
    return Trial(["compiled", "eager"], rounds=3 * regions, warmup=2 * regions)



def shared_trials(regions: list[tuple[Region, torch.nn.Module]]) -> list[tuple[Trial, list[Region]]]:
    """One :func:`speed_trial` per group of identical regions, and the group, for each region in ``regions``' order.

    Identical: the same compiled code (dynamo's cache is per code object) and the same parameter shapes (the same
    work at each call). The group takes one verdict when its trial ends, whichever of its regions made the last call.

    Args:
        regions: each region's record (its ``code``) and module.

    Example:
        >>> a, b, c = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
        >>> ra, rb, rc = Region("a", code="f"), Region("b", code="f"), Region("c", code="f")
        >>> (ta, ga), (tb, gb), (tc, gc) = shared_trials([(ra, a), (rb, b), (rc, c)])
        >>> ta is tb, ta is tc, ta.rounds, tc.rounds, [r.name for r in ga], [r.name for r in gc]
        (True, False, 6, 3, ['a', 'b'], ['c'])
    """
    keys = [(id(region.code) if region.code is not None else id(module),
             tuple(tuple(p.shape) for p in module.parameters())) for region, module in regions]
    groups: dict[Any, list[Region]] = collections.defaultdict(list)
    for key, (region, _) in zip(keys, regions, strict=True):
        groups[key].append(region)
    trials = {key: speed_trial(len(group)) for key, group in groups.items()}
    return [(trials[key], groups[key]) for key in keys]

def limit_message(region: Region, regions: dict[str, Region]) -> tuple[str, list[str]] | None:
    """The warning, and the regions sharing the code, when a guard keeps failing near dynamo's recompile limit.

    That is: ``region``'s code holds half of the limit, and a recompile was not one every run has. Those
    (:func:`~lightning_opkit.compile.watch.expected_recompile`) are counted in the regions table, not warned about:
    they stay bounded.

    Args:
        region: the region that just recompiled.
        regions: every region of the run, by name.
    """
    limit = recompile_limit()
    entries = cache_entries(region.code)
    if entries * 2 < limit or not region.unexpected:
        return None
    sharing = [r.name for r in regions.values() if r.code is region.code]
    guard = " ".join(region.unexpected[-1].split())[:400]
    return (f"TorchCompile: region {region.name or '<LightningModule>'!r} has {entries} compiled versions of its"
            f" code (shared by {len(sharing)} region(s)), half of torch._dynamo.config.recompile_limit={limit};"
            f" past the limit dynamo silently runs it eagerly. The guard that keeps failing: {guard}"), sharing


#: calls of a region remembered for an activation checkpoint's recompute (a block called this often in one step)
_REMEMBERED = 1024


@dataclass
class RegionHooks:
    """What a compiled region reports to its owner, and how it measures itself.

    Args:
        on_failure: called with a compile failure before the call is rerun eagerly; ``None`` re-raises it.
        on_recompile: called after a call that recompiled the region.
        on_slower: called once the region measured slower compiled than eager and runs eagerly from then on.
        speedup: measure eager against compiled time once (:func:`speed_trial`, on its own calls).
        eager_if_slower: run eagerly from then on if eager measured :data:`~lightning_opkit.core.facts.FASTER` times
            faster than compiled (the kit's one speed bar).
        sizes_dynamic: dynamo marks a changed dimension dynamic (``dynamic`` is not ``False``): one recompile per
            such size change is expected.
        agree: rank zero's measured speedup, on every rank (a broadcast under DDP and FSDP2): every rank then runs
            the region the same way, compiled or eager.
    """

    on_failure: Callable[[BaseException], None] | None
    on_recompile: Callable[[Region], None]
    on_slower: Callable[[Region], None] = lambda region: None
    agree: Callable[[float], float] = lambda value: value
    speedup: bool = False
    eager_if_slower: bool = False
    sizes_dynamic: bool = True


class CompiledForward:
    """What replaces a compiled module's ``forward``: run the compiled code, account for it, fall back if it fails.

    Args:
        module: the compiled module.
        region: its record.
        original: its eager ``forward``.
        compiled: ``torch.compile(original, ...)``.
        watch: the run's dynamo watch (counts compiles and recompiles).
        hooks: what it reports to its owner, and how it measures itself.
        shared: the speed trial it shares with identical regions, and those regions (:func:`shared_trials`);
            ``None``: a trial of its own.
    """

    def __init__(self, module: torch.nn.Module, region: Region, original: Callable[..., Any],
                 compiled: Callable[..., Any], watch: DynamoWatch, hooks: RegionHooks,
                 shared: tuple[Trial, list[Region]] | None = None) -> None:
        self.module, self.region, self.original, self.compiled = module, region, original, compiled
        self.watch, self.hooks = watch, hooks
        self.device = next((t.device for t in (*module.parameters(), *module.buffers())), torch.device("cpu"))
        trial, self.group = shared if shared is not None else (speed_trial(), [region])
        self.trial = trial if hooks.speedup or hooks.eager_if_slower else None
        #: whether each recent call that autograd may recompute ran eagerly, newest last (an activation checkpoint
        #: recomputes in backward, newest first, and must run the code its forward ran: it checks it saved the same)
        self._eager_calls: collections.deque[bool] = collections.deque(maxlen=_REMEMBERED)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if RECOMPUTING.depth and self._eager_calls:
            return self._again(args, kwargs)
        region, watch = self.region, self.watch
        region.calls += 1
        recompiles = len(watch.recompile_reasons)
        watch.region = region
        timed = self._trial_slot()
        if torch.is_grad_enabled() and not RECOMPUTING.depth:
            # the speed trial's eager half, a census or replay step's forced eager stance, which ends before
            # backward's recompute, and a region measured slower (a verdict may land between this forward and its
            # recompute: an identical region's call ends their shared trial)
            self._eager_calls.append(timed == "eager" or stance() == "force_eager" or self._slower_now())
        try:
            with self._span():
                out = self._timed(timed, args, kwargs)
        except COMPILE_FAILURES as err:
            if self.hooks.on_failure is None:
                raise
            self.hooks.on_failure(err)
            return self.original(*args, **kwargs)
        finally:
            watch.region = None
        if len(watch.recompile_reasons) != recompiles:
            self._recompiled(watch.recompile_reasons[recompiles:])
        if self.trial is not None and self.trial.done and region.speedup is None:
            self._decide(self.trial.ratio("eager", "compiled"))
        return out

    def _again(self, args: tuple, kwargs: dict) -> Any:
        """A checkpoint's recompute: the code this call's forward ran, eager or compiled, neither timed nor counted."""
        return self.original(*args, **kwargs) if self._eager_calls.pop() else self._compiled(args, kwargs)

    def _trial_slot(self) -> str | None:
        """This call's part in the speed trial: not a replay's or a census step's (a forced eager stance)."""
        if self.trial is None or self.trial.done or stance() != "default" or not torch.is_grad_enabled() or \
                RECOMPUTING.depth:  # an activation checkpoint's recompute in backward is not a call of the step
            return None
        self.region.timing = True
        return self.trial.next()

    def _timed(self, slot: str | None, args: tuple, kwargs: dict) -> Any:
        if slot not in ("compiled", "eager"):
            return self._run(args, kwargs)
        assert self.trial is not None
        self.trial.start(slot, self.device)
        try:
            out = self._run(args, kwargs) if slot == "compiled" else self.original(*args, **kwargs)
        except BaseException:
            self.trial.stop(keep=False)  # a failed compile is not a sample
            raise
        self.trial.stop()
        return out

    def _decide(self, speedup: float) -> None:
        # Every rank takes rank zero's figure (the trial's calls are the same on every rank), so all run the region
        # alike from here, its collectives included.
        agreed = self.hooks.agree(speedup)
        for region in self.group:  # identical regions: one trial, one verdict
            region.speedup = agreed
            if self.hooks.eager_if_slower and agreed * FASTER <= 1:
                region.slower = True
                self.hooks.on_slower(region)

    def _recompiled(self, reasons: list[str]) -> None:
        region = self.region
        region.recompile_reasons += reasons
        region.recompiles += len(reasons)
        for reason in reasons:
            if expected_recompile(reason, region.expected_seen, self.hooks.sizes_dynamic):
                region.expected_recompiles += 1
            else:
                region.unexpected.append(reason)
        self.hooks.on_recompile(region)

    def _span(self) -> Any:
        # While a profiler window records, the region's time is a span named after it.
        if not profiler_enabled():
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"opkit region {self.region.name or '<LightningModule>'}")

    def _slower_now(self) -> bool:
        """Whether a call now runs eagerly because compiled measured slower (its compiled code kept, unused)."""
        return self.region.slower and stance() == "default"

    def _run(self, args: tuple, kwargs: dict) -> Any:
        return self.original(*args, **kwargs) if self._slower_now() else self._compiled(args, kwargs)

    def _compiled(self, args: tuple, kwargs: dict) -> Any:
        if self.region.eager and stance() == "default":
            with torch.compiler.set_stance("eager_on_recompile"):
                return self.compiled(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def nothing_compiled(watch: DynamoWatch, regions: dict[str, Region], compiled: list[str], whole_forward: bool,
                     batches: int) -> str | None:
    """The warning when the first training steps compiled nothing (``None`` when they did, or had compiled before).

    Judged by frames dynamo converted, not by calls into the wrapper: a census or NaN replay runs a step eagerly on
    purpose.

    Args:
        watch: the run's dynamo watch.
        regions: the compiled regions.
        compiled: their paths.
        whole_forward: ``modules=None`` (the LightningModule's forward).
        batches: training batches run so far.
    """
    # Compiled code from an earlier fit (dynamo's cache is per code object) runs without converting a frame.
    if watch.frames == 0 and not any(cache_entries(r.code) for r in regions.values()):
        if watch.frames_attempted:
            hint = (f"It tried {watch.frames_attempted} frame(s) of {compiled} and skipped them (run with"
                    " TORCH_LOGS=graph_breaks to see why); they run eagerly.")
        elif whole_forward:
            hint = ("With modules=None only the LightningModule's forward is compiled, so training_step must"
                    " call self(...); or name the submodules it does call in `modules`.")
        else:
            hint = f"Are the modules {compiled} called in training_step?"
        return (f"TorchCompile: nothing was compiled in the first {batches} training step(s): dynamo converted no"
                f" frame. {hint}")
    if watch.frames and watch.graphs == 0:
        breaks = ", ".join(list(watch.graph_breaks())[:3]) or "-"
        return (f"TorchCompile: nothing was compiled in the first {batches} training step(s): dynamo converted"
                f" {watch.frames} frame(s) of {compiled} but captured no graph, so they run eagerly. Graph breaks:"
                f" {breaks}")
    return None
