"""Tests of lightning_opkit/precision/ (PrecisionPolicy): one file a module, named after it."""
