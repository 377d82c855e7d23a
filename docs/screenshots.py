"""Screenshots of what a user sees in TensorBoard, for the docs: custom scalars, op-class, roofline and memory views.

Trains the example ViT briefly with the callbacks of ``examples/config.yaml`` but ActivationCheckpointing (eager
compile backend, so it takes well under a minute on CPU), writes two pictures the run logged (the roofline and the
memory view by block) as they sit in the event files, serves the logs with TensorBoard on 127.0.0.1, and has headless
Chromium (Debian's ``chromium-headless-shell``) save the pages as PNGs in ``docs/``.

    make screenshots      # or: python docs/screenshots.py
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PAGES = {"custom_scalars.png": "#custom_scalars", "op_classes.png": "#text&tagFilter=op_classes",
         "sensitivity.png": "#text&tagFilter=precision/sensitivity",
         "roofline_table.png": "#text&tagFilter=profiler/roofline", "roofline_plot.png": "#images&tagFilter=roofline",
         "memory_modules.png": "#text&tagFilter=memory/modules"}


def train(log_dir: str) -> None:
    """A short run of the example config (eager compile backend, a profiler window every 12 steps)."""
    from examples.train import main

    config = os.path.join(ROOT, "examples", "config.yaml")
    cli = main(["--config", config, "--trainer.default_root_dir", log_dir, "--trainer.max_epochs", "1",
                "--trainer.limit_train_batches", "60", "--trainer.limit_val_batches", "2",
                "--trainer.logger.init_args.save_dir", log_dir, "--trainer.enable_progress_bar", "false",
                "--trainer.callbacks.init_args.backend", "eager"], run=False)
    # without activation checkpointing, so that the memory view shows what the blocks hold and what checkpointing
    # them would free
    cli.trainer.callbacks = [c for c in cli.trainer.callbacks if type(c).__name__ != "ActivationCheckpointing"]
    for callback in cli.trainer.callbacks:
        if type(callback).__name__ == "ProfilerWindows":
            callback.every_n_steps = 12  # a window (steps 13-15) inside the 23-batch epoch, clear of its last batch
        if type(callback).__name__ == "PrecisionPolicy":
            callback.census_every_n_steps = 10
    cli.trainer.fit(cli.model, cli.datamodule)


def save_logged_picture(log_dir: str, tag: str, out: str) -> None:
    """Write the last image logged under ``tag`` as it sits in the event file (TensorBoard shows it scaled down)."""
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for path in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True):
        acc = EventAccumulator(os.path.dirname(path), size_guidance={"images": 0})
        acc.Reload()
        if tag in acc.Tags().get("images", []):
            with open(out, "wb") as f:
                f.write(acc.Images(tag)[-1].encoded_image_string)
            print(f"wrote {out}")
            return


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    """Train, serve, screenshot."""
    browser = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    if browser is None:
        sys.exit("needs headless Chromium: apt-get install chromium-headless-shell")
    log_dir = tempfile.mkdtemp()
    train(log_dir)
    save_logged_picture(log_dir, "opkit/profiler/roofline_plot", os.path.join(ROOT, "docs", "roofline_example.png"))
    save_logged_picture(log_dir, "opkit/memory/blocks", os.path.join(ROOT, "docs", "memory_blocks.png"))
    port = free_port()
    board = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", log_dir, "--host", "127.0.0.1",
                              "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(60):  # bounded wait for the server to answer
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        for name, fragment in PAGES.items():
            out = os.path.join(ROOT, "docs", name)
            subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            "--window-size=1400,1000", "--virtual-time-budget=15000", f"--screenshot={out}",
                            f"http://127.0.0.1:{port}/{fragment}"], check=True, timeout=120,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            print(f"wrote {out}")
    finally:
        board.terminate()
        board.wait(timeout=30)


if __name__ == "__main__":
    main()
