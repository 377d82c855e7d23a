"""The checks that need a GPU, in one short script: run it once on a CUDA machine and paste its output.

    python benchmarks/gpu_checks.py            # about 3-5 minutes on one GPU

1. ProfilerWindows records CUDA activity (device self time per op class).
2. fp16 with Lightning's GradScaler (16-mixed): PrecisionPolicy runs matmuls in fp16, NaNDetector leaves gradient
   overflow to the scaler, training stays finite.
3. bf16 Tensor Core path: the built-in table under 32-true runs matmuls in bf16.
4. TorchCompile with the cudagraphs Inductor option trains without falling back.
5. rules="auto" on the GPU: bf16 (and fp16 under 16-mixed) measured faster for GEMMs, chosen where accurate; the
   sensitivity tables of the example and GPT-2 (benchmarks/sensitivity.py --accelerator cuda).
6. Overhead ratios on the GPU (benchmarks/overhead.py suites with --accelerator cuda), rules="auto" included.
7. Host cost per op of autocast and of the policy's mode (benchmarks/host_cost.py): the host-bound regime of eager
   GPU steps, where it matters most.
8. rules="auto" at realistic width beside plain fp32 and bf16-mixed, eager and compiled
   (benchmarks/precision_width.py: the GPT-2-style LM and the widened ViT).
9. The roofline on the GPU (ProfilerWindows(roofline=True), bf16-mixed): measured peaks beside the datasheet's,
   the table and picture of the example ViT and the zoo GPT-2 (pictures written to $OUT or the working directory),
   the matmul class's share of the bf16 peak.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402

from examples.vit import DigitsDataModule, ViTClassifier  # noqa: E402
from lightning_opkit import NaNDetector, PrecisionPolicy, ProfilerWindows, TorchCompile  # noqa: E402


def fit(callbacks: list[pl.Callback], steps: int, **kwargs) -> pl.Trainer:
    with tempfile.TemporaryDirectory() as root:
        trainer = pl.Trainer(default_root_dir=root, accelerator="cuda", devices=1, max_steps=steps,
                             callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                             enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0, **kwargs)
        torch.manual_seed(0)
        trainer.fit(ViTClassifier(), DigitsDataModule())
        return trainer


def roofline_check() -> bool:
    """Check 9: the roofline tables and pictures of the example ViT and the zoo GPT-2 on this GPU."""
    from PIL import Image

    from lightning_opkit.profiler.roofline.plot import roofline_image
    from lightning_opkit.profiler.roofline.view import roofline_table

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from zoo import build

    out = os.environ.get("OUT", ".")
    ok = True
    for name in ("vit", "zoo_gpt2"):
        windows = ProfilerWindows(every_n_steps=5, warmup=1, active=2, roofline=True, export_trace=False)
        if name == "vit":
            fit([windows], 8, precision="bf16-mixed")
        else:
            model = build("hf_gpt2")
            with tempfile.TemporaryDirectory() as root:
                pl.Trainer(default_root_dir=root, accelerator="cuda", devices=1, max_steps=8, callbacks=[windows],
                           enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                           precision="bf16-mixed").fit(model, model.loader(n=96))
        report = windows.last_roofline
        print(f"9. roofline, {name}:\n" + roofline_table(report))
        path = os.path.join(out, f"roofline_{name}_gpu.png")
        Image.fromarray(roofline_image(report.rows, report.peaks, f"{name} on {torch.cuda.get_device_name()}")).save(
            path)
        print("   picture:", path)
        matmul = report.rows.get("matmul")
        ok &= bool(matmul and matmul.tflops > 0 and "bf16" in matmul.dtype and report.mfu() is not None)
    return ok


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (these checks need a GPU)")
        return 0
    print(torch.cuda.get_device_name(), torch.__version__)
    ok = True

    prof = ProfilerWindows(every_n_steps=4, warmup=1, active=2)
    fit([prof], 8)
    report = prof.last_report
    device_classes = {c: round(us / 1e3 / report.steps, 3) for c, us in report.class_self_us.items() if us > 0}
    print("1. CUDA profiler: device self ms/step by class", device_classes)
    ok &= bool(report and report.class_self_us.get("matmul", 0) > 0)

    policy = PrecisionPolicy(rules={"matmul": "fp16"}, census_every_n_steps=5)
    detector = NaNDetector(action="raise")
    trainer = fit([policy, detector], 20, precision="16-mixed")
    finite = all(torch.isfinite(p).all() for p in trainer.lightning_module.parameters())
    print("2. fp16 + GradScaler:", {k: v["calls"] for k, v in policy.census.items()}, "finite:", finite,
          "events:", len(detector.events), "scale:", trainer.precision_plugin.scaler.get_scale())
    ok &= finite and ("matmul", "fp16") in policy.census

    policy = PrecisionPolicy(census_every_n_steps=5)
    fit([policy], 10, precision="32-true")
    print("3. bf16 Tensor Cores under 32-true:", sorted(policy.census))
    ok &= ("matmul", "bf16") in policy.census

    compiler = TorchCompile(modules=["model.blocks.*"], options={"triton.cudagraphs": True})
    fit([compiler], 15)
    print("4. cudagraphs:", "fallback: " + str(compiler.error), "compiles:", compiler.watch.compiles,
          "graph breaks:", compiler.watch.graph_breaks())
    ok &= compiler.error is None and compiler.watch.compiles >= 1

    auto = PrecisionPolicy(rules="auto", census_every_n_steps=5)
    fit([auto], 10, precision="16-mixed")
    print("5. rules='auto' under 16-mixed:", {c: (d.dtype, d.reason) for c, d in auto.decisions.items()})
    ok &= auto.measurements is not None and auto.measurements.get("matmul", "bf16") is not None
    ok &= roofline_check()
    here = os.path.dirname(os.path.abspath(__file__))
    subprocess.run([sys.executable, os.path.join(here, "sensitivity.py"), "--accelerator", "cuda"], check=False)

    script = os.path.join(here, "overhead.py")
    for suite in ("nan", "precision", "precision_auto", "profiler", "compile"):
        subprocess.run([sys.executable, script, "--suite", suite, "--accelerator", "cuda", "--reps", "3",
                        "--steps", "60"], check=False)
    subprocess.run([sys.executable, os.path.join(here, "host_cost.py"), "--accelerator", "cuda"], check=False)
    subprocess.run([sys.executable, os.path.join(here, "precision_width.py"), "--accelerator", "cuda", "--reps", "2",
                    "--steps", "40", "--skip", "8"], check=False)
    print("ALL GPU CHECKS PASSED" if ok else "SOME GPU CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
