"""The README's usage example runs as pasted, and its numbers hold."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs_and_fits():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "no python example in the README"
    code = blocks[0] + (
        "\ntf.config.experimental.reset_memory_stats('CPU:0')\n"
        "train_step(x, y)\n"
        "print('PEAK', tf.config.experimental.get_memory_info('CPU:0')['peak'])\n"
    )
    assert len(blocks[0].strip().splitlines()) <= 12
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    peak = int(out.stdout.split("PEAK")[-1].strip())
    assert peak <= 0.08 * 2**30
    first = out.stdout.strip().splitlines()[0].split()
    assert float(first[0]) > 0 and float(first[1]) <= 0.08 * 1024
