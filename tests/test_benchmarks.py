"""The benchmark harness runs (tiny sizes) and prints its ratios; no timing is asserted here."""

import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks", "overhead.py")


def test_overhead_harness_prints_ratios_with_an_a_a_control():
    out = subprocess.run([sys.executable, SCRIPT, "--suite", "nan", "--steps", "8", "--reps", "1", "--skip", "2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"^\s+(.+?)\s+([\d.]+) ms/step\s+ratio vs no callback: ([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["no callback", "NaNDetector (every step)", "detect_anomaly=True",
                                    "no callback (A/A control)"]
    assert float(rows[0][2]) == 1.0
    assert all(float(r[1]) > 0 for r in rows)
    assert "NaNDetector / detect_anomaly:" in out
