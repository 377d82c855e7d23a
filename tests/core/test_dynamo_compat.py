"""Private names of dynamo and Inductor behind core/dynamo_compat.py, each used for real on the running torch: a
release that moves one fails here first."""

import logging

import torch
import torch._dynamo

from lightning_opkit.core.dynamo_compat import (
    COMPILE_FAILURES,
    RECOMPILES_LOGGER,
    backend_callable,
    cache_entries,
    compiled_code,
    counters,
    guard_on_hooks,
    inductor_defaults,
    inductor_kernel_names,
    inductor_modes,
    keep_boxed_call,
    recompile_limit,
    recompiles_artifact,
    skip_code,
    stance,
    watch_compiles,
)


def test_cache_entries_count_one_per_compiled_shape_on_a_real_compile():
    torch._dynamo.reset()

    def double(x):
        return x * 2

    compiled = torch.compile(double, backend="eager", dynamic=False)
    code = compiled_code(compiled)
    assert code is double.__code__
    assert cache_entries(code) == 0
    compiled(torch.ones(2))
    assert cache_entries(code) == 1
    compiled(torch.ones(3))  # a new static shape: a second entry
    assert cache_entries(code) == 2
    assert cache_entries(None) == 0
    torch._dynamo.reset()


def test_the_stance_is_the_one_set_stance_put_in_force():
    assert stance() == "default"
    with torch.compiler.set_stance("force_eager"):
        assert stance() == "force_eager"
    assert stance() == "default"


def test_a_skipped_code_is_never_compiled_as_a_frame_of_its_own():
    torch._dynamo.reset()

    def skipped(x):
        return x + 1

    skip_code(skipped.__code__)
    compiled = torch.compile(skipped, backend="eager")
    compiled(torch.ones(2))
    assert cache_entries(skipped.__code__) == 0
    torch._dynamo.reset()


def test_counters_callbacks_and_the_recompile_log_see_a_real_recompile():
    torch._dynamo.reset()
    events, reasons = [], []

    def start(*args):
        events.append("start")

    def end(*args):
        events.append("end")

    handler = logging.Handler()
    handler.emit = lambda record: reasons.append(record.getMessage())
    logger = logging.getLogger(RECOMPILES_LOGGER)
    was_on = recompiles_artifact()
    recompiles_artifact(enable=True)
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    frames = counters()["frames"]["ok"]
    watch_compiles(start, end, on=True)
    try:
        compiled = torch.compile(lambda x: x * 3, backend="eager", dynamic=False)
        compiled(torch.ones(2))
        compiled(torch.ones(3))  # a failed size guard: a recompile, logged with its reason
    finally:
        watch_compiles(start, end, on=False)
        logger.removeHandler(handler)
        logger.setLevel(level)
        recompiles_artifact(enable=was_on)
    assert events == ["start", "end", "start", "end"]
    assert counters()["frames"]["ok"] - frames == 2
    assert any("size mismatch" in r or "size()" in r for r in reasons), reasons
    watch_compiles(start, end, on=False)  # removing again is no error
    torch._dynamo.reset()


def test_the_backend_callables_and_inductor_s_names_are_torch_compile_s():
    eager = backend_callable("eager", None, None, None)
    f = torch.compile(lambda x: x - 1, backend=eager)
    assert f(torch.ones(2)).tolist() == [0.0, 0.0]
    assert callable(backend_callable("inductor", "default", None, None))
    assert {"default", "reduce-overhead", "max-autotune"} <= set(inductor_modes())
    defaults = inductor_defaults()
    assert "max_autotune" in defaults
    assert isinstance(defaults["max_autotune"], bool)
    assert all(issubclass(e, BaseException) for e in COMPILE_FAILURES)
    torch._dynamo.reset()


def test_backward_outside_autocast_is_functorch_s_own_setting_patched_for_a_while():
    import torch._functorch.config as functorch_config

    from lightning_opkit.core.dynamo_compat import backward_outside_autocast

    before = functorch_config.backward_pass_autocast  # the private name, on the running torch
    with backward_outside_autocast():
        assert functorch_config.backward_pass_autocast == "off"
    assert functorch_config.backward_pass_autocast == before


def test_the_recompile_limit_is_dynamo_s():
    assert recompile_limit() == torch._dynamo.config.recompile_limit
    before = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 3
    try:
        assert recompile_limit() == 3
    finally:
        torch._dynamo.config.recompile_limit = before


def test_the_config_patches_set_what_they_name_and_put_it_back():
    import torch._inductor.config

    before = (torch._dynamo.config.skip_nnmodule_hook_guards, torch._inductor.config.cpp.enable_kernel_profile)
    with guard_on_hooks(), inductor_kernel_names():
        assert torch._dynamo.config.skip_nnmodule_hook_guards is False
        assert torch._inductor.config.cpp.enable_kernel_profile is True
    assert (torch._dynamo.config.skip_nnmodule_hook_guards, torch._inductor.config.cpp.enable_kernel_profile) == before


def test_a_wrapper_of_a_boxed_callable_says_it_is_boxed():
    def boxed(args):
        return args

    boxed._boxed_call = True
    wrapper, plain = (lambda args: args), (lambda *args: args)
    keep_boxed_call(boxed, wrapper)
    keep_boxed_call(lambda *args: args, plain)
    assert getattr(wrapper, "_boxed_call", False) is True
    assert not hasattr(plain, "_boxed_call")
