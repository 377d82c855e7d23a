"""Tests of lightning_opkit/compile/ (TorchCompile): one file a module, named after it."""
