"""Train the tiny ViT with LightningCLI: ``python examples/train.py fit --config examples/config.yaml``."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from lightning.pytorch.cli import LightningCLI  # noqa: E402

import lightning_opkit  # noqa: E402, F401  (imported so that short class names resolve: --trainer.callbacks+=NaNDetector)
from examples.vit import DigitsDataModule, ViTClassifier  # noqa: E402


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Build (and by default run) the CLI.

    Args:
        args: command-line arguments; ``None`` reads ``sys.argv``.
        run: run the subcommand (``False`` only parses and instantiates, for tests).
    """
    return LightningCLI(
        ViTClassifier, DigitsDataModule, args=args, run=run, save_config_kwargs={"overwrite": True}
    )


if __name__ == "__main__":
    main()
