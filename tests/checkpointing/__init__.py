"""Tests of lightning_opkit/checkpointing/ (ActivationCheckpointing): one file a module, named after it."""
