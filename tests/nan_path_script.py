"""Prints, as JSON, the package files whose functions run while NaNDetector handles one skipped step, in the order
each is first entered: from ``on_before_optimizer_step`` of the bad step to the end of its batch (the report's tags
written). Run in a fresh interpreter, so no cache filled by an earlier test hides a file.

    python tests/nan_path_script.py ROOT_DIR
"""

import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lightning.pytorch as pl  # noqa: E402
from helpers import TinyNet, make_loader, trainer  # noqa: E402

import lightning_opkit  # noqa: E402
from lightning_opkit import NaNDetector  # noqa: E402

PACKAGE = str(pathlib.Path(lightning_opkit.__file__).parent) + os.sep


class Trace(pl.Callback):
    """``sys.setprofile`` over the bad step, from before NaNDetector's hook (it is listed first) to the batch's end."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.files: list[str] = []
        self.calls = 0

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            self.calls += 1
            path = frame.f_code.co_filename[len(PACKAGE):]
            if path not in self.files:
                self.files.append(path)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step == self.step:
            sys.setprofile(self._profile)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        sys.setprofile(None)


if __name__ == "__main__":
    trace, detector = Trace(2), NaNDetector(action="skip")
    trainer(pathlib.Path(sys.argv[1]), [trace, detector], max_steps=4).fit(TinyNet(param_grad_steps=(2,)),
                                                                             make_loader())
    print(json.dumps({"files": trace.files, "calls": trace.calls, "skipped": detector.skipped_steps}))
