"""ninfer-convert build ORG/NAME against a real, offline Hugging Face cache.

The cache is laid out byte for byte as huggingface_hub lays it out (models--org--name/ with
blobs/<git sha1 or LFS sha256>, snapshots/<commit>/<file> relative symlinks into blobs/, and
refs/<branch or tag> holding the commit), then the converter runs in a subprocess with
HF_HUB_OFFLINE=1 and HF_HUB_CACHE pointing at it: huggingface_hub's own resolution is tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ninfer_runtime.artifact import Artifact

REPO = "tiny-org/tiny-qwen"
COMMITS = {"main": "1f" * 20, "older": "2e" * 20}


def blob_id(path: Path) -> str:
    """The name the hub gives a file's blob: LFS files by sha256, the rest by git's sha1."""
    data = path.read_bytes()
    if path.suffix == ".safetensors":
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def add_snapshot(cache: Path, repo: str, ref: str, commit: str, checkpoint: Path) -> None:
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in sorted(checkpoint.iterdir()):
        blob = root / "blobs" / blob_id(f)
        blob.write_bytes(f.read_bytes())
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / ref).write_text(commit)


@pytest.fixture(scope="module")
def hub_cache(tiny_checkpoint, tmp_path_factory) -> Path:
    cache = tmp_path_factory.mktemp("hf_cache")
    add_snapshot(cache, REPO, "main", COMMITS["main"], tiny_checkpoint("dense", seed=0))
    add_snapshot(cache, REPO, "older", COMMITS["older"], tiny_checkpoint("dense", seed=1))
    return cache


def run_cli(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache),
           "HF_HOME": str(cache.parent / "hf_home")}
    return subprocess.run([sys.executable, "-c", "from ninfer_convert.cli import main; main()",
                           "build", *args], env=env, capture_output=True, text=True,
                          timeout=120)


def test_repo_id_converts_from_the_cache_and_records_the_commit(hub_cache, tiny_checkpoint,
                                                                tmp_path):
    out = tmp_path / "hub.ninfer"
    proc = run_cli(hub_cache, REPO, "--weights", "bf16", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    a = Artifact.open(out)
    assert a.manifest["source"] == {"kind": "hub", "repo_id": REPO, "revision": COMMITS["main"]}
    assert a.manifest["random_init"] is False
    assert a.tokenizer_json == (tiny_checkpoint("dense") / "tokenizer.json").read_text()
    # The weights are those of the main snapshot: compare with a tag that holds other ones.
    proc = run_cli(hub_cache, REPO, "--revision", "older", "--weights", "bf16", "-o",
                   str(tmp_path / "older.ninfer"))
    assert proc.returncode == 0, proc.stderr
    older = Artifact.open(tmp_path / "older.ninfer")
    assert older.manifest["source"]["revision"] == COMMITS["older"]
    name = "layers.0.mlp.down_proj.weight"
    assert not torch.equal(a.weight(name), older.weight(name))


def test_repo_missing_from_the_offline_cache_fails_cleanly(hub_cache, tmp_path):
    out = tmp_path / "out"
    proc = run_cli(hub_cache, "tiny-org/not-cached", "--weights", "bf16", "-o",
                   str(out / "m.ninfer"))
    assert proc.returncode == 1
    assert "cannot fetch tiny-org/not-cached from the Hugging Face hub" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_snapshot_layout_is_the_hub_layout(hub_cache):
    """Guards the fixture itself: what huggingface_hub's cache scanner reports."""
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_cache)
    (repo,) = [r for r in info.repos if r.repo_id == REPO]
    assert {r.commit_hash for r in repo.revisions} == set(COMMITS.values())
    refs = {ref for r in repo.revisions for ref in r.refs}
    assert refs == {"main", "older"}
    assert not info.warnings
    files = {f.file_name for r in repo.revisions for f in r.files}
    assert {"config.json", "tokenizer.json", "model.safetensors", "mtp.safetensors"} <= files
    assert json.loads(next(f for r in repo.revisions for f in r.files
                           if f.file_name == "config.json").file_path.read_text())
