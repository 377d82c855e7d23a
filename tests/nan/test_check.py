"""The one cheap check (nan/check.py): flags for the loss and every gradient from one fused reduction, the values a
spike is scored on, and a non-finite norm from finite but huge gradients told apart from a real NaN/Inf."""

import math

import torch

from lightning_opkit.nan.check import (
    FINITE_ONLY_ELEMENTS,
    OUTCOMES,
    Checked,
    FiniteOnly,
    Outcome,
    all_finite,
    check,
    finite_only,
    flags,
    outcome,
)


def test_a_finite_step_flags_nothing_and_hands_on_its_log_values():
    grads = [torch.full((3,), 3.0), torch.full((4,), 4.0)]
    checked = check([torch.tensor(2.0), torch.tensor(4.0)], grads, torch.device("cpu"))
    assert (checked.loss_bad, checked.grad_bad, checked.dead) == (False, False, False)
    assert math.isclose(checked.values[0], math.log1p(3.0), rel_tol=1e-6)  # the micro-batches' mean loss, through log1p
    assert math.isclose(checked.values[1], math.log(math.sqrt(9 * 3 + 16 * 4)), rel_tol=1e-6)
    assert checked.norms.tolist() == [torch.tensor(27.0).sqrt().item(), 8.0]


def test_a_nan_loss_and_an_inf_gradient_are_each_flagged():
    checked = check([torch.tensor(float("nan"))], [torch.tensor([1.0, float("inf")])], torch.device("cpu"))
    assert checked.loss_bad
    assert checked.grad_bad


def test_a_finite_gradient_whose_norm_overflows_is_not_a_fault():
    big = torch.full((8,), 60000.0, dtype=torch.half)  # fp16 gradients whose norm passes 65504: finite all the same
    assert not check([torch.tensor(1.0)], [big], torch.device("cpu")).grad_bad
    found, _, _ = flags([], [big], torch.device("cpu"))
    assert math.isfinite(found[1].item())  # the norm is taken in fp32
    assert math.isclose(found[1].item(), 60000.0 * math.sqrt(8), rel_tol=1e-6)


def test_all_finite_over_tensors_of_several_dtypes():
    assert bool(all_finite([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)]))
    assert not bool(all_finite([torch.ones(2), torch.tensor([float("-inf")], dtype=torch.half)]))


def test_outcome_is_the_one_decision_of_a_checked_step():
    asked, scored = [], []

    def forward_fault(answer):
        return lambda: asked.append(answer) or answer

    def score(spiked):
        return lambda checked: scored.append(checked) or (spiked, (7.5 if spiked else 0.5, 0.25))

    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    scaler.scale(torch.ones(()))  # the scale tensor exists from the first scale on
    healthy, nan_loss, nan_grads = Checked(False, False), Checked(True, False), Checked(False, True)
    assert outcome(healthy, None, None, forward_fault(False)) == Outcome("healthy")
    assert outcome(healthy, score(None), None, forward_fault(False)) == Outcome("healthy", None, (0.5, 0.25))
    assert outcome(healthy, score("loss"), None, forward_fault(False)) == Outcome("spike", "loss", (7.5, 0.25))
    assert outcome(nan_loss, score("loss"), scaler, forward_fault(False)) == Outcome("non-finite")
    assert asked == []  # the forward replays are asked for nothing but non-finite gradients under a scaler
    assert scored == [healthy, healthy]  # a non-finite step is not scored
    assert outcome(nan_grads, None, scaler, forward_fault(False)) == Outcome("scaler overflow", scale=4096.0)
    assert outcome(nan_grads, None, scaler, forward_fault(True)).kind == "non-finite"
    assert outcome(nan_grads, None, None, forward_fault(True)).kind == "non-finite"
    assert asked == [False, True]
    assert set(OUTCOMES) == {"healthy", "spike", "scaler overflow", "non-finite"}


def test_non_finite_values_reach_the_host_as_inf_whatever_their_sign_and_the_logs_are_taken_there():
    for bad in (float("nan"), float("inf"), float("-inf")):
        found, own, _ = flags([torch.tensor(bad)], [torch.tensor([bad, 1.0])], torch.device("cpu"))
        assert found.tolist() == [math.inf, math.inf]  # a collective's maximum keeps +inf, not a NaN
        assert not own.isfinite().any()  # this rank's own values stay as they were
    checked = check([torch.tensor(-3.0)], [torch.zeros(2)], torch.device("cpu"))
    assert not checked.loss_bad
    assert not checked.grad_bad
    assert checked.values[0] == -math.log1p(3.0)
    assert checked.values[1] < -60  # log of a zero norm, finite


# The check without norms (nan/check.py: finite_only): on CPU one in-place pass over the losses and gradients.

def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[tensor.element_size()]).clone()


def _cases():
    """Losses and gradients of several dtypes, each case with the non-finite places put in by hand."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for bad in (None, "loss nan", "grad inf", "grad -inf", "grad nan", "huge"):
            grads = [torch.randn(n, generator=gen).to(dtype) for n in (7, 300, 1)]
            grads[1][:4] = torch.tensor([0.0, -0.0, 1e-40, -6e-8]).to(dtype)  # signed zeros, subnormals
            losses = [torch.tensor(2.5)]
            if bad == "loss nan":
                losses = [torch.tensor(1.0), torch.tensor(float("nan"))]
            elif bad == "huge":  # finite, but its norm overflows fp32 (or fp16 where it is one): not a fault
                grads[0][0] = torch.finfo(dtype).max
            elif bad is not None:
                grads[2 if "nan" in bad else 1][-1] = float(bad.split()[1])
            yield dtype, bad, losses, grads


def test_the_check_without_norms_says_what_an_element_by_element_look_says_and_leaves_every_bit_in_place():
    for dtype, bad, losses, grads in _cases():
        before = [_bits(t) for t in losses + grads]
        observed = (not all(bool(x.isfinite().all()) for x in losses),
                    not all(bool(g.isfinite().all()) for g in grads))  # the independent look
        found = finite_only(losses, grads)
        assert found is not None, (dtype, bad)
        assert found.tolist() == [float(any(observed))], (dtype, bad)
        checked = check(losses, grads, torch.device("cpu"), norms=False)
        assert (checked.loss_bad, checked.grad_bad) == observed, (dtype, bad)
        assert (checked.loss_bad, checked.grad_bad) == (lambda c: (c.loss_bad, c.grad_bad))(
            check(losses, grads, torch.device("cpu"))), (dtype, bad)  # as the check with norms says
        assert all(torch.equal(b, _bits(t)) for b, t in zip(before, losses + grads, strict=True)), (dtype, bad)


def test_the_check_without_norms_hands_over_where_its_pass_does_not_apply_and_the_full_check_decides():
    nan = torch.tensor([1.0, float("nan")])
    # complex, elements that overlap (an expanded gradient), sparse: the full check takes them
    for grads in ([torch.tensor([1j, float("inf")])], [torch.ones(1).expand(4)], [torch.ones(3).to_sparse()]):
        assert finite_only([torch.tensor(1.0)], grads) is None
    assert check([torch.tensor(1.0)], [torch.ones(1).expand(4), nan], torch.device("cpu"), norms=False).grad_bad
    # past the size where a norm per gradient costs less
    assert FINITE_ONLY_ELEMENTS < 1 << 24
    assert finite_only([torch.tensor(1.0)], [torch.zeros(FINITE_ONLY_ELEMENTS), nan]) is None


def test_one_quick_check_kept_across_steps_says_at_each_what_a_fresh_one_and_an_element_by_element_look_say():
    """What a fit's :class:`FiniteOnly` keeps between steps (what it allowed, its flag's storage) never carries a step's
    answer into the next: each step of a mixed sequence is told as a fresh check and an independent look tell it."""
    quick = FiniteOnly()
    weight = torch.randn(3, requires_grad=True)
    (weight.sin().sum()).backward(create_graph=True)
    steps = [(dtype, bad, losses, grads) for dtype, bad, losses, grads in _cases()]
    steps.insert(3, ("create_graph", None, [torch.tensor(1.0)], [weight.grad]))  # same count, a graph's gradient
    steps.insert(5, ("complex", None, [torch.tensor(1.0)], [torch.tensor([1j, 2.0]), torch.ones(2), torch.ones(1)]))
    steps.insert(8, ("sparse", None, [torch.tensor(1.0)], [torch.ones(3).to_sparse()]))
    answers = []
    for dtype, bad, losses, grads in steps:
        kept, fresh = quick(losses, grads), finite_only(losses, grads)
        assert (kept is None) == (fresh is None), (dtype, bad)
        if kept is not None:
            observed = not all(bool(t.isfinite().all()) for t in losses + grads)
            assert kept.tolist() == fresh.tolist() == [float(observed)], (dtype, bad)
        answers.append(None if kept is None else kept.tolist()[0])
    # the sequence held healthy steps right after faulty ones, and steps the pass hands over between them
    assert {None, 0.0, 1.0} <= set(answers)
    assert any(a == 1.0 and b == 0.0 for a, b in zip(answers, answers[1:]))


def test_gradients_of_a_create_graph_backward_are_not_written_so_their_graph_still_runs():
    weight = torch.randn(4, 3, requires_grad=True)
    loss = (weight.sin() * 2).sum()
    loss.backward(create_graph=True)
    assert weight.grad.requires_grad
    assert finite_only([loss.detach().clone()], [weight.grad]) is None
    checked = check([loss.detach().clone()], [weight.grad], torch.device("cpu"), norms=False)
    assert (checked.loss_bad, checked.grad_bad) == (False, False)
    penalty = weight.grad.square().sum()
    (hessian_term,) = torch.autograd.grad(penalty, weight)  # the gradient's own graph runs: nothing wrote into it
    assert torch.allclose(hessian_term, -8 * weight.cos() * weight.sin())
