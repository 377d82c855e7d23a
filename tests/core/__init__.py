"""Tests of lightning_opkit/core/ (the shared core): one file a module, named after it."""
