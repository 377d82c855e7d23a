"""Optional, in-place, regional ``torch.compile``: :class:`TorchCompile` over Trainer-free parts.

- :mod:`.torch_compile`: :class:`TorchCompile`, the Lightning callback.
- :mod:`.config`: argument checks, and the backend callable.
- :mod:`.compiled_forward`: the forward that replaces a compiled module's, and what it accounts per call.
- :mod:`.regions`: a region's record (calls, compiles, speedup) and dynamo's cache per code object.
- :mod:`.state_keys`: checkpoints written by ``torch.compile``'s wrapper (``_orig_mod.`` keys) load into the plain
  model.
- :mod:`.watch`: dynamo's compile time, graphs, graph breaks and recompile reasons, watched from outside.
"""

from lightning_opkit.compile.torch_compile import TorchCompile

__all__ = ["TorchCompile"]
