"""Tests of lightning_opkit/nan/ (NaNDetector): one file a module, named after it."""
