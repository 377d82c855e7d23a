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
    assert [r[0] for r in rows] == ["no callback", "NaNDetector (every step)", "NaNDetector (repair=False)",
                                    "NaNDetector (spike_zscore=6)", "detect_anomaly=True", "no callback (A/A control)"]
    assert float(rows[0][2]) == 1.0
    assert all(float(r[1]) > 0 for r in rows)
    assert "NaNDetector / detect_anomaly:" in out
    assert "repair on / off" in out
    assert "spikes on / off" in out
    assert "time inside NaNDetector's hooks with spike_zscore=6" in out


def test_roofline_cost_harness_prints_the_ratio_with_and_without_the_roofline(tmp_path):
    script = os.path.join(os.path.dirname(SCRIPT), "roofline_cost.py")
    picture = tmp_path / "roofline.png"
    out = subprocess.run([sys.executable, script, "--reps", "1", "--steps", "7", "--every", "3", "--save",
                          str(picture)], capture_output=True, text=True, timeout=600, check=True).stdout
    rows = re.findall(r"^\s+(windows.*?)\s+close\s+([\d.]+) ms/window \(ratio\s+([\d.]+)\)", out, re.M)
    assert [r[0] for r in rows] == ["windows", "windows + roofline", "windows (A/A)"]
    assert float(rows[0][2]) == 1.0
    assert "the roofline's extra cost per window" in out
    assert "| matmul | fp32 |" in out
    assert picture.stat().st_size > 10_000


def test_spike_false_alarm_harness_prints_the_rate():
    script = os.path.join(os.path.dirname(SCRIPT), "spike_false_alarms.py")
    out = subprocess.run([sys.executable, script, "--steps", "30", "--models", "torch_mha", "hf_gpt2"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"^\s+(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert [r[0] for r in rows] == ["torch_mha", "hf_gpt2"]
    assert all(int(r[1]) == 10 for r in rows)  # 30 steps, 20 of warm-up
    assert re.search(r"false-alarm rate: \d+ in 20 judged steps", out)


def test_checkpointing_harness_prints_bytes_and_time_ratios():
    script = os.path.join(os.path.dirname(SCRIPT), "checkpointing.py")
    out = subprocess.run([sys.executable, script, "--reps", "1", "--models", "cnn"], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    rows = re.findall(r"^\s+(.+?)\s+([\d.]+) MB saved \(([\d.]+)\)\s+([\d.]+) ms/step \(([\d.]+)\)$", out, re.M)
    assert [r[0] for r in rows] == ["none", "full", "selective (GEMMs kept)", "every other block (full)"]
    assert float(rows[0][2]) == 1.0
    assert float(rows[1][2]) < float(rows[2][2]) < 1.0  # full frees most, keeping the convolutions frees less


def test_layout_harness_prints_the_roofline_fact_beside_the_whole_step_ratio():
    script = os.path.join(os.path.dirname(SCRIPT), "layout.py")
    out = subprocess.run([sys.executable, script, "--reps", "1", "--widths", "8", "--batch", "4", "--size", "16"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"width\s+(\d+): roofline's conv fact ([\d.]+)\s+whole step ([\d.]+) -> ([\d.]+) ms \(([\d.]+)\)",
                      out)
    assert [r[0] for r in rows] == ["8"]
    assert float(rows[0][1]) > 0
    assert float(rows[0][4]) > 0
    assert re.search(r"^machine: .+, \d+ threads, torch ", out, re.M)


def test_fp8_harness_prints_each_dtype_against_fp32():
    script = os.path.join(os.path.dirname(SCRIPT), "fp8.py")
    out = subprocess.run([sys.executable, script, "--width", "32", "--tokens", "16", "--reps", "1", "--calls", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = re.findall(r"^\s+(.+?)\s+([\d.]+) ms/step\s+time ratio vs fp32: ([\d.]+)$", out, re.M)
    assert [r[0] for r in rows] == ["fp32", "bf16 (autocast)", "fp8 (tensorwise)"]
    assert float(rows[0][2]) == 1.0
    assert all(float(r[1]) > 0 for r in rows)
    assert re.search(r"^fp8 / bf16: [\d.]+ \(above 1: fp8 slower\)$", out, re.M)
