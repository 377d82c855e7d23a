"""Tests of lightning_opkit/profiler/ (ProfilerWindows): one file a module, named after it."""
