"""Run by test_sharded.py: 2 CPU processes (gloo) under Lightning's ModelParallelStrategy, FSDP2 or tensor parallel.

A 3-block MLP whose block 1 writes a NaN into its output on rank 1 only, at global step 3. Each fit's result on each
rank goes to ``<out>/<name>.rank<r>.json``: NaN events, the state of this rank's shards before and after the bad step,
the full weights at the end (gathered), and what each callback saw.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from helpers import SkewedAuto, make_loader  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402
from zoo import ZooModule  # noqa: E402

from examples.vit import ViTClassifier, load_digits_tensors  # noqa: E402
from lightning_opkit import (  # noqa: E402
    ActivationCheckpointing,
    NaNDetector,
    NonFiniteError,
    PrecisionPolicy,
    ProfilerWindows,
    TorchCompile,
    replaying,
)
from lightning_opkit.core.facts import facts_of  # noqa: E402
from lightning_opkit.profiler.roofline.levers import lever  # noqa: E402

BAD_STEP = 3


class RankPoison(nn.Module):
    """Identity, except at BAD_STEP on rank 1, in the step itself and in its replays (grad mode on)."""

    def __init__(self):
        super().__init__()
        self.trainer = None
        self.grad_only = False  # a NaN gradient in the real step's backward only, never in a replay

    def forward(self, x):
        t = self.trainer
        if t is None or t.global_rank != 1 or t.global_step != BAD_STEP or not torch.is_grad_enabled():
            return x
        if not self.grad_only:
            return x * float("nan")
        if not replaying() and x.requires_grad:
            x = x.clone()
            x.register_hook(lambda grad: torch.full_like(grad, float("nan")))
        return x


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc1, self.act, self.fc2, self.norm = nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d), nn.LayerNorm(d)
        self.poison = RankPoison()  # armed in block 1 only (Probe)

    def forward(self, x):
        return self.norm(x + self.poison(self.fc2(self.act(self.fc1(x)))))


class ShardedMLP(pl.LightningModule):
    def __init__(self, layout, d=16, mixed=False, fused=False, manual=False):
        super().__init__()
        self.layout, self.mixed, self.fused = layout, mixed, fused
        self.automatic_optimization = not manual
        self.inp = nn.Linear(8, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(3)])
        self.head = nn.Linear(d, 4)
        self.dtypes = {}  # op seen -> dtypes, from forward hooks

    def configure_model(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        if self.layout == "tp":
            for block in self.blocks:
                parallelize_module(block, self.device_mesh["tensor_parallel"],
                                   {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            return
        mesh = self.device_mesh["data_parallel"]
        kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} \
            if self.mixed else {}
        for block in self.blocks:
            fully_shard(block, mesh=mesh, **kwargs)
        fully_shard(self, mesh=mesh, **kwargs)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).float(), y)
        if not self.automatic_optimization:  # the step trains itself
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused or None)


class ShardedZoo(ZooModule):
    """A zoo model with each repeated block and the root fully_shard'ed; its forward fault fires on rank 1 only."""

    def _hit(self, kind):
        return self.global_rank == 1 and super()._hit(kind)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        from lightning_opkit import find_blocks

        mesh = self.device_mesh["data_parallel"]
        for name in find_blocks(self):
            fully_shard(self.get_submodule(name), mesh=mesh)
        fully_shard(self, mesh=mesh)


class ShardedViT(ViTClassifier):
    """The example ViT with each block and the root fully_shard'ed; block 1's output goes NaN on rank 1 at step 3."""

    def __init__(self):
        super().__init__()
        self.model.blocks[1].register_forward_hook(self._poison)

    def _poison(self, module, args, output):
        if self.global_rank == 1 and self.trainer.global_step == BAD_STEP and self.training:
            return output * float("nan")
        return None

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)


def local(t):
    t = t.to_local() if hasattr(t, "to_local") else t
    # under fp8_all_gather a float8 module's shard is torchao's wrapper over the same storage until teardown
    return t if type(t) is torch.Tensor or not hasattr(t, "fsdp_pre_all_gather") else t._tensor


class GatherProbe(pl.Callback):
    """fp8_all_gather: the weight the first gathered module's GEMM is handed (in training and, by step, in opkit's
    replays), the state dict mid-fit, a checkpoint written then."""

    def __init__(self, path):
        self.path, self.seen, self.replayed, self.mid_fit_state, self.hook = path, set(), {}, None, None
        self.float8_steps = set()  # the training steps in which the GEMM was handed a float8 weight
        self.scale_kept = []  # the steps whose end still held a precomputed float8 scale

    def on_train_start(self, trainer, pl_module):
        policy = next(c for c in trainer.callbacks if isinstance(c, PrecisionPolicy))

        @torch.compiler.disable  # eager under TorchCompile too: the tensor FSDP2 hands over, not dynamo's fake of it
        def seen(module, args):
            handed = kind(module.weight)
            if replaying():
                self.replayed.setdefault(trainer.global_step, set()).add(handed)
                return
            self.seen.add(handed)
            if handed != "Tensor":
                self.float8_steps.add(trainer.global_step)

        self.module = pl_module.get_submodule(policy.fp8.gather.gathered[0])
        self.hook = self.module.register_forward_pre_hook(seen)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        # the scale precomputed at the batch's start, dropped by the optimizer step (the weights changed)
        if getattr(self.module.weight._local_tensor, "_precomputed_scale", None) is not None:
            self.scale_kept.append(trainer.global_step)
        if trainer.global_step == 5:
            self.mid_fit_state = sorted({kind(local_or_self(v)) for v in pl_module.state_dict().values()})
            trainer.save_checkpoint(self.path)

    def result(self, model, policy, batch):
        """After the fit: what was seen, the shards' types, and the weight a forward after teardown is handed."""
        seen, self.seen = sorted(self.seen), set()
        after = sorted({kind(local_or_self(p)) for p in model.parameters()})
        model(batch if isinstance(model, ZooModule) else batch[0])  # after teardown FSDP2 gathers the plain weight
        self.hook.remove()
        replayed = {step: sorted(kinds) for step, kinds in self.replayed.items()}
        return {"seen": seen, "replayed": replayed, "float8_steps": sorted(self.float8_steps),
                "scale_kept": self.scale_kept,
                "after_forward": sorted(self.seen),
                "mid_fit_state": self.mid_fit_state, "after": after,
                "state_dict_hooks": sum(len(m._state_dict_hooks) for m in model.modules()),
                "gathered": policy.fp8.gather.gathered, "skipped": policy.fp8.gather.skipped, "ckpt": self.path}


def kind(t):
    """A tensor's type name, a Parameter of a plain tensor being a plain ``Tensor``."""
    return "Tensor" if type(t) in (torch.Tensor, nn.Parameter) else type(t).__name__


def local_or_self(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def shard_state(trainer, model):
    """This rank's shards of every parameter, buffer and optimizer state, and the learning rates, as lists."""
    opt = trainer.optimizers[0]
    state = {f"param:{n}": local(p).detach().float().flatten().tolist() for n, p in model.named_parameters()}
    state.update({f"buffer:{n}": local(b).float().flatten().tolist() for n, b in model.named_buffers()})
    stepped = [opt.state[p] for g in opt.param_groups for p in g["params"] if p in opt.state]
    for i, per_param in enumerate(stepped):
        for k, v in per_param.items():
            state[f"opt:{i}:{k}"] = local(v).float().flatten().tolist() if torch.is_tensor(v) else v
    state["lr"] = [g["lr"] for g in opt.param_groups]
    return state


class Probe(pl.Callback):
    def __init__(self):
        self.before = self.after = None
        self.losses = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if isinstance(pl_module, ShardedMLP):
            pl_module.blocks[1].poison.trainer = trainer
            pl_module.blocks[1].poison.grad_only = "shard" in trainer.default_root_dir
        if trainer.global_step == BAD_STEP:
            self.before = shard_state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses[trainer.global_step] = float(local(loss))
        if self.before is not None and self.after is None:
            self.after = shard_state(trainer, pl_module)


def callbacks_for(name, root):
    made = {}
    everything = "all4" in name or "all5" in name  # all5: ActivationCheckpointing and the memory view too
    if "nan" in name or everything:
        made["nan"] = NaNDetector(action="raise" if "raise" in name else "skip",
                                  decide="device" if "device" in name else "host")
    if "auto" in name and "gather" in name:
        # auto measuring (again every 4 steps) while each block's fc1 runs float8 GEMMs, its weight gathered in float8
        made["precision"] = PrecisionPolicy(rules="auto", overrides={"blocks.*.fc1": "fp8"}, remeasure_every_n_steps=4,
                                            census_every_n_steps=2, fp8_all_gather=True)
    elif "auto" in name:
        # auto-fp8: each Linear measured in float8 too (on a CPU, slower: none chosen), in lockstep on both ranks
        made["precision"] = SkewedAuto(rules="auto", census_every_n_steps=2, try_fp8=True if "fp8" in name else None)
    elif "fp8" in name:
        made["precision"] = PrecisionPolicy(rules={"matmul": "fp8"}, census_every_n_steps=2, measure=False,
                                            fp8_all_gather="gather" in name)
    elif "precision" in name or everything:
        made["precision"] = PrecisionPolicy(census_every_n_steps=2, measure=False)
    if "profiler" in name or everything:
        # logger=False: the traces asked for with log_dir
        made["profiler"] = ProfilerWindows(every_n_steps=4, warmup=1, active=2, all_ranks=True, log_dir=root,
                                           roofline=name.startswith("profiler"), memory_breakdown="all5" in name)
    if "compile" in name or everything:
        # all5: compile's eager-against-compiled calls (census every 2 steps: 16 steps) would hold the checkpointing
        # price back past these 10 steps (one timed trial at a time); the compile runs time it
        made["compile"] = TorchCompile(modules=None if "whole" in name else "auto", backend="eager",
                                       measure="all5" not in name)
    if "all5" in name:
        made["checkpointing"] = ActivationCheckpointing(measure=True, trial_steps=1)
    return made


def resume(out, layout, name):
    """Train 6 steps, save the strategy's checkpoint (distributed or full), resume to 10 steps in a new Trainer."""
    full = name.endswith("full")
    path = os.path.join(out, name, "last.ckpt")
    states = []
    for steps, ckpt in ((6, None), (10, path)):
        torch.manual_seed(0)
        made = callbacks_for("nan-skip profiler", os.path.join(out, name))
        probe = Probe()
        strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                         save_distributed_checkpoint=not full)
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                             callbacks=[*made.values(), probe], enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=os.path.join(out, name))
        trainer.fit(ShardedMLP(layout), make_loader(n=256, batch_size=8), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(path)
        states.append({"events": [e["step"] for e in made["nan"].events], "skipped": made["nan"].skipped_steps,
                       "windows": made["profiler"].windows_done, "batches": made["profiler"].batches_seen,
                       "traces": [os.path.basename(p) for p in made["profiler"].trace_files],
                       "global_step": trainer.global_step})
    with open(os.path.join(out, f"{name}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(states, f)


def model_and_loader(layout, name):
    if layout == "vit":
        return ShardedViT(), DataLoader(TensorDataset(*load_digits_tensors()), batch_size=16)
    if layout.startswith("zoo:"):
        model = ShardedZoo(layout[4:], faults={"forward": BAD_STEP})
        return model, model.loader(n=96)
    return ShardedMLP(layout, mixed="mixed" in name, fused="device" in name, manual="manual" in name), \
        make_loader(n=256, batch_size=8)


def fit(out, layout, name, steps=10):
    # each run as in a process of its own: dynamo's cache is per code object, and the blocks' forward is one code
    # object over every run here, so later runs would find its recompile limit reached and run it eagerly
    torch._dynamo.reset()
    torch.manual_seed(0)
    made = callbacks_for(name, os.path.join(out, name))
    probe = Probe()
    gather = GatherProbe(os.path.join(out, f"{name}.ckpt")) if "gather" in name else None
    strategy = ModelParallelStrategy(data_parallel_size=1 if layout == "tp" else 2,
                                     tensor_parallel_size=2 if layout == "tp" else 1,
                                     save_distributed_checkpoint=gather is None)  # a full checkpoint: one file
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                         callbacks=[*made.values(), probe, *[gather] * (gather is not None)],
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=os.path.join(out, name))
    model, loader = model_and_loader(layout, name)
    try:
        trainer.fit(model, loader)
        outcome = "finished"
    except NonFiniteError as err:
        outcome = "raised: " + str(err)[:200]
    gathered = gather.result(model, made["precision"], next(iter(loader))) if gather is not None else None
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    result = {
        "outcome": outcome,
        "global_step": trainer.global_step,
        "weights": {k: v.float().nan_to_num(1234.5).flatten().tolist() for k, v in full.items()},
        "losses": probe.losses,
        "changed_at_bad_step": None if probe.after is None else sorted(
            k for k in probe.before if probe.before[k] != probe.after[k]),
        "hooks_left": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
    }
    if gathered is not None:
        result["gather"] = gathered
        # the scales' drop after each optimizer step is a step hook: gone with the fit, as after an exception
        gathered["optimizer_hooks"] = sum(len(o._optimizer_step_post_hooks) for o in trainer.optimizers)
    if "nan" in made:
        result["events"] = [[e["step"], e["phase"], e["module"], e["rank"], e["cause"]] for e in made["nan"].events]
        result["parameters"] = [e["parameter"] for e in made["nan"].events]
        result["skipped"] = made["nan"].skipped_steps
    if "precision" in made:
        result["census"] = sorted(f"{c}:{d}" for c, d in made["precision"].census)
        result["table"] = made["precision"].table
        choice = made["precision"].choice
        result["chosen"] = choice.chosen if choice is not None else None
        result["fp8"] = [made["precision"].fp8.converted, sorted(made["precision"].fp8.skipped)]
        fact = facts_of(trainer).fp8
        result["fp8_fact"] = None if fact is None else [fact.timed, list(fact.chosen), fact.speed.ratio]
    if "profiler" in made:
        report = made["profiler"].last_report
        result["traces"] = [os.path.basename(p) for p in made["profiler"].trace_files]
        result["classes"] = report.class_percent() if report else {}
        result["ops"] = {r.name: r.op_class for r in report.ops} if report else {}
        result["collective_calls"] = {r.name: r.calls for r in report.ops if r.name.startswith("c10d::")} \
            if report else {}
        result["communication"] = [report.communication_us, report.exposed_communication_us] if report else None
        result["step_ms"] = report.step_time_ms if report else None
        roofline = made["profiler"].last_roofline
        if roofline is not None:
            comm = roofline.rows.get("communication")
            result["roofline"] = {"link_gbps": roofline.peaks.link_gbps, "mfu": roofline.mfu(),
                                  "matmul_gflops": roofline.rows["matmul"].flops / 1e9 / roofline.steps,
                                  "comm_bytes": comm.bytes / roofline.steps if comm else 0.0,
                                  "comm_lever": lever(comm, roofline) if comm else ""}
    if "checkpointing" in made:
        price = made["checkpointing"].price
        result["checkpointed"] = made["checkpointing"].checkpointed
        result["saved_cut"] = price.cut if price else None
        memory = made["profiler"].memory_report
        result["memory"] = None if memory is None else [memory.parameters, memory.gradients, memory.activations]
        result["local_parameter_bytes"] = sum(local(p).untyped_storage().nbytes() for p in model.parameters())
    if "compile" in made:
        result["compiled"] = made["compile"].compiled
        result["frames"] = made["compile"].watch.frames
        result["compile_error"] = made["compile"].error
    with open(os.path.join(out, f"{name}.rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    out, layout, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    for name in names:
        (resume if name.startswith("resume") else fit)(out, layout, name)
