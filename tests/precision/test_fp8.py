"""float8 GEMMs (``"fp8"``): the zoo trains close to bf16-mixed, the model is as before after, what cannot run in fp8
is named, ``rules="auto"`` on a CPU never picks it, and an fp8 overflow is repaired.

Tolerance of the loss curves, over 100 steps against bf16-mixed: each step's loss within 5%, the mean of the last ten
within 1%, and at least 80% of bf16-mixed's fall from the first step to the last ten. Measured on this suite's CPU:
at most 2.0% on one step (Llama), 0.3% on the last ten; the float8 GEMMs' own relative output error is about 3%.
"""

from __future__ import annotations

import math
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, read_events, snapshot, trainer
from torch import nn
from zoo import MOE, ZooModule

from lightning_opkit import NaNDetector, PrecisionPolicy
from lightning_opkit.precision.fp8 import Float8Linears, fp8_modules, gemm_dims, gemm_function, recipe_problem, refusal


class Losses(pl.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _train(tmp_path, case, callbacks, steps, precision="bf16-mixed", **kwargs):
    torch.manual_seed(0)
    model = ZooModule(case, **kwargs)
    losses = Losses()
    run = trainer(tmp_path, [*callbacks, losses], max_steps=steps, max_epochs=-1, precision=precision)
    run.fit(model, model.loader(n=64))
    return model, losses.losses


@pytest.mark.parametrize("case", ["hf_gpt2", "hf_llama", MOE])
def test_explicit_fp8_trains_the_zoo_close_to_bf16_mixed_and_leaves_the_model_as_it_was(tmp_path, case):
    name = case if isinstance(case, str) else case.name
    _, plain = _train(tmp_path / "bf16", case, [], 100)
    policy = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=50, measure=False)
    torch.manual_seed(0)
    model = ZooModule(case)
    before, keys = snapshot(model), list(model.state_dict())
    losses = Losses()
    trainer(tmp_path, [policy, losses], max_steps=100, max_epochs=-1, precision="bf16-mixed").fit(
        model, model.loader(n=64))
    assert len(losses.losses) == len(plain) == 100
    assert all(math.isfinite(x) for x in losses.losses)
    for ours, theirs in zip(losses.losses, plain):
        assert abs(ours - theirs) <= 0.05 * abs(theirs), (ours, theirs)
    last, last_plain = sum(losses.losses[-10:]) / 10, sum(plain[-10:]) / 10
    assert abs(last - last_plain) <= 0.01 * last_plain
    assert losses.losses[0] - last >= 0.8 * (plain[0] - last_plain) > 0  # it learns as bf16-mixed does
    # every Linear (GPT-2's Conv1D too) ran in fp8
    gemms = [n for n, m in model.named_modules() if gemm_dims(m) is not None]
    assert sorted(policy.fp8.converted) == sorted(gemms)
    assert not policy.fp8.skipped
    if name == "hf_mixtral":  # the experts' fused 3-D GEMMs are no Linear: the matmul class's next dtype, bf16
        assert ("matmul", "bf16") in policy.census
    # the census counts the float8 GEMMs, with their error against fp32
    row = policy.census[("matmul", "fp8")]
    assert row["calls"] == len(policy.fp8.converted)
    assert 0 < row["rel_error"] < 0.1
    assert snapshot(model) == before  # forwards restored: no patch, no hook left
    assert list(model.state_dict()) == keys
    _, texts = read_events(str(tmp_path))
    assert "**float8 GEMMs** (tensorwise scaling, torchao)" in texts["opkit/precision/policy"][0][1]
    summary = texts["opkit/summary"][-1][1]
    assert f"fp8: {len(policy.fp8.converted)} GEMM module(s) in float8" in summary


def test_a_checkpoint_of_an_fp8_run_loads_into_the_plain_model(tmp_path):
    policy = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=0, measure=False)
    model, losses = _train(tmp_path, "hf_llama", [policy], 4, precision="32-true")
    assert all(math.isfinite(x) for x in losses)
    assert len(policy.fp8.converted) == 15
    path = tmp_path / "fp8.ckpt"
    torch.save(model.state_dict(), path)
    plain = ZooModule("hf_llama")
    plain.load_state_dict(torch.load(path), strict=True)
    batch = next(iter(model.loader(n=8)))
    with torch.no_grad():
        assert torch.equal(plain(batch), model(batch))  # after teardown both run plain fp32 Linears
    assert all(type(m).forward is nn.Linear.forward and "forward" not in vars(m)
               for m in plain.modules() if isinstance(m, nn.Linear))


def test_module_overrides_choose_which_linears_run_in_fp8(tmp_path):
    mlp = "model.model.layers.0.mlp"
    policy = PrecisionPolicy(rules={"matmul": "fp32"}, overrides={f"{mlp}": "fp8", f"{mlp}.down_proj": "bf16"},
                             census_every_n_steps=1, measure=False)
    model, losses = _train(tmp_path, "hf_llama", [policy], 2, precision="32-true")
    assert all(math.isfinite(x) for x in losses)
    assert sorted(policy.fp8.converted) == [f"{mlp}.gate_proj", f"{mlp}.up_proj"]  # the innermost override decides
    assert policy.fp8.by_override == set(policy.fp8.converted)
    assert policy.census[("matmul", "fp8")]["override"]
    assert ("matmul", "bf16") in policy.census  # down_proj
    _, texts = read_events(str(tmp_path))
    assert f"| {mlp}.gate_proj | fp8 | module override |" in texts["opkit/precision/policy"][0][1]


def test_a_linear_fp8_cannot_take_runs_in_bf16_and_is_named(tmp_path):
    # the zoo's LSTM classifier ends in Linear(32, 3): not a multiple of 16
    policy = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=1, measure=False)
    _, losses = _train(tmp_path, "torch_lstm", [policy], 2, precision="32-true")
    assert all(math.isfinite(x) for x in losses)
    model = ZooModule("torch_lstm")
    gemms = {n: gemm_dims(m) for n, m in model.named_modules() if gemm_dims(m) is not None}
    odd = {n for n, d in gemms.items() if d[0] % 16 or d[1] % 16}
    assert odd
    assert set(policy.fp8.skipped) == odd
    assert ("matmul", "bf16") in policy.census
    _, texts = read_events(str(tmp_path))
    summary = texts["opkit/summary"][-1][1]
    assert f"fp8: left in bf16: {sorted(odd)[0]} (" in summary
    assert "float8 GEMMs need dimensions that are multiples of 16" in texts["opkit/precision/policy"][0][1]


def test_rules_auto_on_a_cpu_never_picks_fp8_and_says_why(tmp_path):
    policy = PrecisionPolicy(rules="auto", census_every_n_steps=0, trial_steps=0)
    _train(tmp_path, "hf_llama", [policy], 2, precision="32-true")
    assert "fp8" not in policy.table.values()
    assert not policy.fp8.converted
    _, texts = read_events(str(tmp_path))
    assert "fp8: not tried by rules='auto' (a CPU has no float8 GEMM units" in texts["opkit/summary"][-1][1]


class OutlierNet(pl.LightningModule):
    """A Linear whose input row at step 2 sums to just under fp32's largest value: finite in fp32, inf in float8.

    ``proj``'s weight is all ones and frozen (exact in float8: its amax scales to 448). At step 2 one input row holds
    M = 1.16e37 once and 0.9 M 31 times. In fp32 each output is 28.9 M = 3.35e38, under fp32's 3.40e38. float8 scales
    M to 448 exactly and rounds 0.9 M (403.2 scaled) up to 416, so the same sum is 29.8 M = 3.46e38: inf, in whatever
    order a kernel sums and applies the scales. The output is scaled back before the head.
    """

    OUTLIER = 1.16e37

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.head = nn.Linear(32, 16)
        with torch.no_grad():
            self.proj.weight.fill_(1.0)
        self.proj.weight.requires_grad_(False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.global_step == 2 and self.training:
            x = x.clone()
            x[0] = 0.9 * self.OUTLIER
            x[0, 0] = self.OUTLIER
        return F.cross_entropy(self.head(self.proj(x) * 1e-38), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def test_an_fp8_overflow_is_named_with_cause_precision_and_the_module_pinned_back(tmp_path):
    torch.manual_seed(0)
    model = OutlierNet()
    before = snapshot(model)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 16, (64,), generator=g))
    policy = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=0, measure=False)
    detector, losses = NaNDetector(action="skip"), Losses()
    trainer(tmp_path, [policy, detector, losses], max_steps=6, precision="32-true").fit(
        model, torch.utils.data.DataLoader(data, batch_size=8))
    assert [(e["step"], e["module"], e["cause"]) for e in detector.events] == [(2, "proj", "precision")]
    assert detector.events[0]["repair"] == "proj -> fp32"
    assert detector.skipped_steps == 1
    assert policy.fp8.converted == ["head"]  # proj runs its GEMM in fp32 from the repair on
    assert not math.isfinite(losses.losses[2])
    assert all(math.isfinite(x) for i, x in enumerate(losses.losses) if i != 2)
    assert snapshot(model) == before


class Halved(nn.Linear):
    """A Linear subclass whose forward computes more than its GEMM."""

    def forward(self, x):
        return super().forward(x) * 0.5


def test_a_linear_with_its_own_forward_and_attentions_out_proj_are_named_and_the_observer_agrees(tmp_path):
    """nn.TransformerEncoder's attention reads out_proj's weight itself; a Linear subclass computes more than a GEMM.

    Neither is reported in float8: the dispatcher (tests/observer.py) sees float8 kernels in exactly the modules the
    policy table lists, none in those it names as left out, and the subclass's own forward still halves its output.
    """
    from observer import GemmObserver, StepMark

    torch.manual_seed(0)
    model = ZooModule("torch_encoder")
    head = model.model.head
    model.model.head = Halved(head.in_features, head.out_features)
    outputs = []
    model.model.head.register_forward_hook(
        lambda m, args, out: outputs.append((args[0], out, m.weight.detach().clone(), m.bias.detach().clone())))
    policy = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=1, measure=False)
    observer = GemmObserver(model)
    run = trainer(tmp_path, [policy, StepMark(observer)], max_steps=2, max_epochs=-1, precision="32-true")
    with observer:
        run.fit(model, model.loader(n=16))
    skipped = {n: why for n, why in policy.fp8.skipped.items()}
    assert skipped["model.head"] == "Halved has a forward of its own: kept as written"
    out_projs = {n for n, m in model.named_modules() if n.endswith("self_attn.out_proj")}
    assert len(out_projs) == 2
    assert all("nn.MultiheadAttention reads its weight directly" in skipped[n] for n in out_projs)
    in_fp8 = {module for _, module, _, dtype in observer.records if dtype == "fp8"}
    assert in_fp8 == set(policy.fp8.converted)
    assert observer.dtypes_of("model.head") == {"bf16"}  # as the summary says: left in bf16
    x, out, weight, bias = outputs[-1]
    expected = F.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()) * 0.5
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the subclass's forward, its GEMM in bf16
    summary = read_events(str(tmp_path))[1]["opkit/summary"][-1][1]
    assert "model.head (Halved has a forward of its own: kept as written)" in summary


def test_a_census_of_float8_gemms_inside_activation_checkpoints_leaves_the_recompute_as_the_forward(tmp_path):
    # The census's fp32 reference of a float8 GEMM ran with autograd on: a checkpointed block's forward saved its
    # tensors, the recompute (no census there) did not, and torch.utils.checkpoint raised CheckpointError at the
    # first census step. Every step a census step here; the same losses as without the census.
    from lightning_opkit import ActivationCheckpointing

    def run(census):
        policy = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=census, measure=False)
        checkpointing = ActivationCheckpointing(measure=True, trial_steps=1)
        _, losses = _train(tmp_path / str(census), "hf_llama", [policy, checkpointing], 3, precision="32-true")
        return policy, checkpointing, losses

    policy, checkpointing, losses = run(1)
    assert checkpointing.checkpointed == ["model.model.layers.0", "model.model.layers.1"]
    assert ("matmul", "fp8") in policy.census
    assert losses == run(0)[2]


def test_fp8_arguments_are_checked_at_construction():
    with pytest.raises(ValueError, match=r"`rules\['conv'\]` is 'fp8': float8 runs the GEMMs of Linear layers"):
        PrecisionPolicy(rules={"conv": "fp8"})
    with pytest.raises(ValueError, match=r"Expected `fp8_recipe` to be one of \['tensorwise', 'rowwise'\]"):
        PrecisionPolicy(rules={"matmul": "fp8"}, fp8_recipe="blockwise")
    with pytest.raises(ValueError, match=r"Expected `default` to be one of .*'fp8' is a GEMM dtype"):
        PrecisionPolicy(default="fp8")


def test_fp8_under_16_mixed_is_refused_at_setup_naming_why(tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    policy = PrecisionPolicy(rules={"matmul": "fp8"}, measure=False)
    scaler = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    run = trainer(tmp_path, [policy], max_steps=1, plugins=[scaler])
    model = ZooModule("hf_llama")
    with pytest.raises(ValueError, match=r"runs \['matmul \(fp8: its other ops in bf16\)'\] in bf16 while"
                                         r" Trainer\(precision='16-mixed'\)"):
        run.fit(model, model.loader(n=8))
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_fp8_without_torchao_fails_at_construction_naming_the_extra():
    code = ("import sys; sys.modules['torchao'] = None\n"
            "from lightning_opkit import PrecisionPolicy\n"
            "PrecisionPolicy(rules={'matmul': 'fp32'})  # no fp8: fine without torchao\n"
            "try:\n    PrecisionPolicy(overrides={'model.mlp': 'fp8'})\n"
            "except ImportError as err:\n    print(err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("PrecisionPolicy(overrides={'model.mlp': 'fp8'}) runs float8 GEMMs through torchao:"
                                  " torchao is not installed: pip install 'lightning_opkit[fp8]'")


def test_a_recipe_this_torch_cannot_run_leaves_every_linear_in_bf16_named():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    fp8 = Float8Linears("rowwise", census=lambda: None)
    fp8.convert(list(model.named_children()), torch.device("cpu"))
    problem = recipe_problem("rowwise", "cpu")
    if problem is None:  # torch 2.13 and later run rowwise float8 GEMMs on a CPU
        assert fp8.converted == ["0", "1"]
        assert not fp8.skipped
    else:  # torch 2.11: per-tensor scales only on a CPU
        assert problem.startswith(f"torch {torch.__version__} runs no rowwise float8 GEMM on a CPU (")
        assert fp8.skipped == {"0": problem, "1": problem}
        assert not fp8.converted
    model(torch.randn(4, 32)).sum().backward()  # either way it trains
    fp8.restore()


def test_the_innermost_override_decides_which_linears_and_refusals_say_why():
    model = nn.Sequential(nn.Linear(32, 32), nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 48)), nn.Linear(48, 5))
    picked = fp8_modules(model, {"matmul": "fp8"}, {"1": "fp32", "1.1": "fp8"})
    assert [n for n, _ in picked[False]] == ["0", "2"]
    assert [n for n, _ in picked[True]] == ["1.1"]
    assert refusal(model[2], torch.device("cpu")) == "48x5: float8 GEMMs need dimensions that are multiples of 16"
    assert refusal(model[0], torch.device("cpu")) is None


def test_a_replay_runs_converted_modules_as_written_and_a_revert_is_for_good():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    x = torch.randn(4, 32)
    exact = model(x)
    fp8 = Float8Linears("tensorwise", census=lambda: None)
    fp8.convert(list(model.named_children()), torch.device("cpu"))
    low = model(x)
    assert not torch.equal(low, exact)
    with fp8.plain(model[1]):
        assert fp8.inside(model) == ["0", "1"]
        assert torch.equal(model[1](model[0](x)), model[1].__class__.forward(model[1], model[0](x)))
    with fp8.plain(None):
        assert torch.equal(model(x), exact)
    assert torch.equal(model(x), low)  # out of the replay: float8 again
    assert fp8.revert("0")
    assert not fp8.revert("0")
    assert fp8.converted == ["1"]
    assert "forward" not in vars(model[0])
    fp8.restore()
    assert torch.equal(model(x), exact)


def test_a_batch_whose_rows_are_not_a_multiple_of_16_trains_with_the_inner_dimension_padded():
    # CUDA's _scaled_mm needs the inner dimension in multiples of 16, and the weight gradient's inner dimension is the
    # batch's rows (an LM's batch x (seq - 1) tokens): padded with zeros, the values are those of the unpadded GEMM
    _, config, mm_config = gemm_function("tensorwise")
    assert config.pad_inner_dim
    assert mm_config.grad_weight.pad_inner_dim
    assert mm_config.output.pad_inner_dim
    torch.manual_seed(0)
    linear, x = nn.Linear(32, 32), torch.randn(7, 32, requires_grad=True)
    fp8 = Float8Linears("tensorwise", census=lambda: None)
    fp8.convert([("linear", linear)], torch.device("cpu"))
    out = linear(x)
    out.square().mean().backward()
    fp8.restore()
    padded_grad = linear.weight.grad.clone()
    linear.weight.grad = None
    assert torch.isfinite(padded_grad).all()
    exact = linear(x)
    exact.square().mean().backward()
    # float8's own error, no more: the padding's zeros add nothing
    assert torch.nn.functional.cosine_similarity(padded_grad.flatten(), linear.weight.grad.flatten(), dim=0) > 0.99
    assert (out - exact).norm() / exact.norm() < 0.1


def test_importing_torchao_through_opkit_prints_nothing_a_user_cannot_act_on():
    """On a CPU, torchao's CUDA-only kernels fail to load and a torch newer than torchao warns of an Enum it registers:
    a bare import prints those lines, the kit's first import of torchao drops them (and only them)."""
    def stderr_of(code):
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              timeout=300).stderr

    bare = stderr_of("import torchao.float8.float8_linear")
    quiet = stderr_of("from lightning_opkit import PrecisionPolicy; PrecisionPolicy(rules={'matmul': 'fp8'})")
    noise = ("Failed to load", "is an Enum subclass")
    from importlib.metadata import version

    if not torch.cuda.is_available() and version("torchao") == "0.18.0":  # the pinned torchao says both
        assert any(n in bare for n in noise), bare
    assert not any(n in quiet for n in noise), quiet


def test_explicit_fp8_on_a_cpu_warns_once_at_setup_with_its_cost(tmp_path):
    policy = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=0, measure=False)
    said_first = r"Linear\(s\) run float8 GEMMs on cpu: a CPU has no float8 GEMM units"
    with pytest.warns(UserWarning, match=said_first) as said:
        _train(tmp_path, "hf_llama", [policy], 2, precision="32-true")
    assert len([w for w in said if "run float8 GEMMs on cpu" in str(w.message)]) == 1
    assert f"{len(policy.fp8.converted)} Linear(s)" in next(str(w.message) for w in said if "float8 GEMMs" in
                                                             str(w.message))
