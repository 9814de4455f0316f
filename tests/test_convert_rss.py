"""Streaming: converting a multi-shard checkpoint never holds more than a few tensors.

The conversion runs in a child process that reports its own peak RSS (ru_maxrss); a second
child that only imports the same modules gives the baseline (torch alone is ~200 MB). File
reads (not mmap) are what keeps the checkpoint's pages out of the RSS.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# A tiny-profile architecture made wide: ~300 MB of bf16 in 5 shards plus the mtp shard; the
# largest output is the fused MLP gate|up, 2 x 4096 x 1024 bf16 = 16 MiB.
WIDE = {"hidden_size": 1024, "intermediate_size": 4096, "linear_num_key_heads": 4,
        "linear_key_head_dim": 128, "linear_num_value_heads": 8, "linear_value_head_dim": 128,
        "num_attention_heads": 8, "head_dim": 128}
LARGEST_OUTPUT = 2 * 4096 * 1024 * 2

CHILD = """
import resource, sys
from pathlib import Path
from ninfer_convert.build import BuildOptions, build
from ninfer_convert.sources import open_source
if len(sys.argv) > 1:
    build(open_source(sys.argv[1]), Path(sys.argv[2]), BuildOptions(weights="bf16"))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def peak_rss(*args: str) -> int:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True,
                          timeout=120, check=True)
    return int(proc.stdout.split()[-1])


def test_peak_rss_stays_far_below_the_checkpoint(tiny_checkpoint, tmp_path):
    src: Path = tiny_checkpoint("dense", max_shard_size="64MB", text_overrides=WIDE)
    shards = list(src.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in shards)
    assert len(shards) >= 5 and size > 250e6
    baseline = peak_rss()
    used = peak_rss(str(src), str(tmp_path / "wide.ninfer")) - baseline
    assert (tmp_path / "wide.ninfer").stat().st_size > size * 0.9  # it did convert everything
    assert used < size / 3, f"peak RSS grew by {used / 1e6:.0f} MB for {size / 1e6:.0f} MB"
    assert used < 4 * LARGEST_OUTPUT, f"peak RSS grew by {used / 1e6:.0f} MB"
