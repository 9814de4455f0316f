"""The `.ninfer` format: round trip, safetensors compatibility, mmap, atomic writes, and one
ArtifactError (naming file and tensor) per kind of bad input."""

from __future__ import annotations

import gc
import json
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ninfer_convert.inspect import describe
from ninfer_runtime.artifact import FORMAT_VERSION, Artifact, ArtifactError, ArtifactWriter
from ninfer_runtime.artifact import WeightSpec as W
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.profiles import get_profile
from ninfer_runtime.quant import PackedWeight

TOKENIZER = '{"model": {"vocab": {"wörld": 0}}}'.encode()
# The longest float repr but one: the header must have reserved room for it on every weight.
LONG_ERROR = 2.2250738585072014e-308

SPECS = [
    W("embed_tokens.weight", "bf16", (9, 8)),
    W("layers.0.linear_attn.A_log", "fp32", (3,)),
    W("layers.0.mlp.gate_up_proj.weight", "nvfp4", (6, 32)),
    W("layers.0.mlp.experts.down_proj", "nvfp4", (2, 4, 16)),
    W("layers.0.mlp.down_proj.weight", "groupwise-int", (3, 256)),
    W("norm.weight", "bf16", (7,)),
]


def _manifest(**changes: Any) -> dict[str, Any]:
    profile = get_profile("tiny_dense")
    return {"profile": profile.name, "weights_id": "nvfp4",
            "source": {"kind": "random-init", "seed": 7}, "config": profile.hf_config,
            "generation_config": profile.generation_config, "chat_template": "{{ messages }}",
            "options": {"lm_head": "bf16"}, **changes}


def _parts(spec: W, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Hand-made parts of the dtypes and shapes in quant/__init__.py's table."""
    *lead, k = spec.shape
    u8 = lambda *s: torch.randint(0, 256, s, dtype=torch.uint8, generator=gen)  # noqa: E731
    rand = lambda *s: torch.rand(s, generator=gen)  # noqa: E731
    if spec.scheme == "nvfp4":
        return {"weight": u8(*lead, k // 2),
                "weight_scale": rand(*lead, k // 16).to(torch.float8_e4m3fn),
                "weight_scale_2": rand(*lead)}
    if spec.scheme == "groupwise-int":
        return {"weight": u8(*lead, k // 2), "weight_scale": rand(*lead, k // 128).bfloat16(),
                "weight_zero": u8(*lead, k // 128)}
    dtype = torch.float32 if spec.scheme == "fp32" else torch.bfloat16
    return {"weight": torch.randn(spec.shape, generator=gen).to(dtype)}


@pytest.fixture
def parts() -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return {s.name: _parts(s, gen) for s in SPECS}


def _write(path: Path, parts: dict[str, dict[str, torch.Tensor]], **manifest: Any) -> Path:
    with ArtifactWriter(path, _manifest(**manifest), SPECS, {"tokenizer_json": len(TOKENIZER)}
                        ) as w:
        w.write_blob("tokenizer_json", TOKENIZER)
        for spec in reversed(SPECS):  # any order: each tensor has its planned offset
            quantized = spec.scheme in ("nvfp4", "groupwise-int")
            w.write_weight(spec.name, parts[spec.name], LONG_ERROR if quantized else None)
    return path


@pytest.fixture
def written(tmp_path: Path, parts: dict[str, dict[str, torch.Tensor]]) -> Path:
    return _write(tmp_path / "model.ninfer", parts)


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8),
                                                                     b.view(torch.uint8))


# -- round trip --------------------------------------------------------------------------------


def test_round_trip(written: Path, parts: dict[str, dict[str, torch.Tensor]]) -> None:
    a = Artifact.open(written)
    assert a.weight_names() == [s.name for s in SPECS]
    for spec in SPECS:
        w = a.weight(spec.name)
        if spec.scheme in ("bf16", "fp32"):
            assert isinstance(w, torch.Tensor) and _equal(w, parts[spec.name]["weight"])
        else:
            assert isinstance(w, PackedWeight) and w.scheme.name == spec.scheme
            assert w.shape == spec.shape and set(w.parts) == set(parts[spec.name])
            for role, t in parts[spec.name].items():
                assert _equal(w.parts[role], t), (spec.name, role)
    assert set(a.weights()) == {s.name for s in SPECS}
    m = a.manifest
    assert m["weights"]["layers.0.mlp.down_proj.weight"] == {
        "scheme": "groupwise-int", "shape": [3, 256], "error": LONG_ERROR}
    assert m["weights"]["norm.weight"]["error"] is None
    assert (m["format"], m["format_version"], m["checksum_algorithm"]) == ("ninfer", 1, "crc32")
    assert m["random_init"] is True and m["source"] == {"kind": "random-init", "seed": 7}
    assert m["options"] == {"lm_head": "bf16"} and m["profile"] == "tiny_dense"
    assert a.weights_id == "nvfp4" and a.chat_template == "{{ messages }}"
    assert a.generation_config == get_profile("tiny_dense").generation_config
    assert a.tokenizer_json == TOKENIZER.decode()
    assert a.config == ModelConfig.from_hf(get_profile("tiny_dense").hf_config)
    assert not any(n.startswith("__pad") for n in m["tensors"])


def test_no_blobs_means_no_tokenizer(tmp_path: Path) -> None:
    spec = W("norm.weight", "bf16", (4,))
    with ArtifactWriter(tmp_path / "a.ninfer", _manifest(chat_template=None), [spec], {}) as w:
        w.write_weight(spec.name, {"weight": torch.ones(4, dtype=torch.bfloat16)})
    a = Artifact.open(tmp_path / "a.ninfer")
    assert a.tokenizer_json is None and a.chat_template is None


def test_safetensors_reads_it(written: Path, parts: dict[str, dict[str, torch.Tensor]]) -> None:
    a = Artifact.open(written)
    with safe_open(str(written), framework="pt") as f:
        assert json.loads(f.metadata()["ninfer"])["weights_id"] == "nvfp4"
        stored = {k for k in f.keys() if not k.startswith("__pad.")}  # noqa: SIM118
        assert stored == set(a.manifest["tensors"])
        assert _equal(f.get_tensor("layers.0.mlp.gate_up_proj.weight_scale"),
                      parts["layers.0.mlp.gate_up_proj.weight"]["weight_scale"])
        assert bytes(f.get_tensor("__blob.tokenizer_json").numpy()) == TOKENIZER


def test_every_tensor_is_64_byte_aligned(written: Path) -> None:
    (n,) = struct.unpack("<Q", written.read_bytes()[:8])
    header = json.loads(written.read_bytes()[8:8 + n])
    assert (8 + n) % 64 == 0
    starts = [e["data_offsets"][0] for k, e in header.items()
              if k != "__metadata__" and not k.startswith("__pad.")]
    assert len(starts) == 13 and all(s % 64 == 0 for s in starts)


def test_tensors_are_views_of_one_file_mapping(written: Path) -> None:
    a = Artifact.open(written)
    t = a.stored("embed_tokens.weight")
    storage = t.untyped_storage()
    base, size = storage.data_ptr(), storage.nbytes()
    assert size == written.stat().st_size  # one storage spanning the whole file, no copy
    for name in a.manifest["tensors"]:
        s = a.stored(name)
        assert s.untyped_storage().data_ptr() == base
        assert base <= s.data_ptr() and s.data_ptr() + s.nbytes <= base + size
    # ...and that storage is a mapping of the file itself, not an anonymous buffer.
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    regions = [tuple(int(x, 16) for x in m[0].split("-")) for m in maps
               if len(m) >= 6 and m[5] == str(written.resolve())]
    assert any(lo <= t.data_ptr() < hi for lo, hi in regions)


def test_mapping_is_private(written: Path) -> None:
    """Writing into a loaded tensor (e.g. an in-place op by mistake) never changes the file."""
    before = written.read_bytes()
    Artifact.open(written).stored("norm.weight").fill_(3.0)
    assert written.read_bytes() == before


# -- atomic writes ----------------------------------------------------------------------------


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_failed_write_leaves_nothing(tmp_path: Path, parts: dict[str, dict[str, torch.Tensor]],
                                     exc: type[BaseException]) -> None:
    target = tmp_path / "model.ninfer"
    with pytest.raises(exc), ArtifactWriter(target, _manifest(), SPECS, {}) as w:
        w.write_weight(SPECS[0].name, parts[SPECS[0].name])
        assert w.tmp_path.exists() and not target.exists()
        raise exc
    assert _leftovers(tmp_path) == []


def test_failed_rewrite_keeps_old_file(written: Path,
                                       parts: dict[str, dict[str, torch.Tensor]]) -> None:
    before = written.read_bytes()
    with pytest.raises(ArtifactError, match="never written"), \
            ArtifactWriter(written, _manifest(), SPECS, {}) as w:
        w.write_weight(SPECS[0].name, parts[SPECS[0].name])  # and stop early
    assert written.read_bytes() == before and _leftovers(written.parent) == [written.name]


def test_dropped_writer_removes_temp(tmp_path: Path) -> None:
    w = ArtifactWriter(tmp_path / "a.ninfer", _manifest(), SPECS, {})
    assert w.tmp_path.exists()
    del w
    gc.collect()
    assert _leftovers(tmp_path) == []


def test_writer_rejects_wrong_parts(tmp_path: Path,
                                    parts: dict[str, dict[str, torch.Tensor]]) -> None:
    name = "layers.0.mlp.gate_up_proj.weight"
    bad = {**parts[name], "weight_scale": parts[name]["weight_scale"].float()}
    with pytest.raises(ArtifactError) as e, ArtifactWriter(tmp_path / "a", _manifest(), SPECS,
                                                           {}) as w:
        w.write_weight(name, bad)
    assert e.value.tensor == "layers.0.mlp.gate_up_proj.weight_scale"
    assert str(tmp_path / "a") in str(e.value) and "float8_e4m3fn" in str(e.value)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize(("specs", "manifest", "match"), [
    ([W("x.weight", "int3", (4, 4))], {}, "unknown weight scheme 'int3'"),
    ([W("x.weight", "nvfp4", (4, 10))], {}, "multiple of 16"),
    ([W("__x", "bf16", (1,))], {}, "reserved"),
    ([W("x.weight", "bf16", (1,))] * 2, {}, "planned twice"),
    ([], {"weights_id": "int8"}, "weights_id"),
    ([], {"format_version": 2}, "not the caller's"),
])
def test_writer_rejects_bad_plans(tmp_path: Path, specs: list[W], manifest: dict[str, Any],
                                  match: str) -> None:
    with pytest.raises(ArtifactError, match=match):
        ArtifactWriter(tmp_path / "a.ninfer", _manifest(**manifest), specs, {})
    assert _leftovers(tmp_path) == []


# -- bad files --------------------------------------------------------------------------------


def _edit(path: Path, edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> None:
    """Rewrites the header in place (same reserved size, so every offset stays valid);
    `edit(header, manifest)` mutates both."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    manifest = json.loads(header["__metadata__"]["ninfer"])
    edit(header, manifest)
    header["__metadata__"]["ninfer"] = json.dumps(manifest, separators=(",", ":"))
    encoded = json.dumps(header, separators=(",", ":")).encode()
    assert len(encoded) <= n
    path.write_bytes(raw[:8] + encoded.ljust(n) + raw[8 + n:])


def _open_fails(path: Path, match: str, tensor: str | None = None, **kw: bool) -> None:
    with pytest.raises(ArtifactError, match=match) as e:
        Artifact.open(path, **kw)
    assert str(path) in str(e.value)
    assert e.value.tensor == tensor
    if tensor:
        assert repr(tensor) in str(e.value)


def test_not_safetensors(tmp_path: Path) -> None:
    path = tmp_path / "notes.ninfer"
    path.write_text("hello, this is not a model\n" * 10)
    _open_fails(path, "not a safetensors file")
    (tmp_path / "tiny").write_bytes(b"abc")
    _open_fails(tmp_path / "tiny", "not a safetensors file")
    _open_fails(tmp_path / "absent.ninfer", "cannot read: No such file")
    _open_fails(tmp_path, "cannot read")


def test_plain_safetensors_is_not_ninfer(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    _open_fails(path, "without NInfer metadata")


def test_wrong_format_version(written: Path) -> None:
    _edit(written, lambda h, m: m.update(format_version=2))
    _open_fails(written, f"format version 2; this NInfer reads version {FORMAT_VERSION}")


def test_truncated_file(written: Path) -> None:
    data = written.read_bytes()
    written.write_bytes(data[:-10])  # the last tensor in plan order is the tokenizer blob
    _open_fails(written, "truncated", "__blob.tokenizer_json")
    written.write_bytes(data[:-200])
    _open_fails(written, "truncated", "layers.0.mlp.down_proj.weight_zero")


def test_bad_checksum(written: Path) -> None:
    a = Artifact.open(written)
    offset = a.stored("layers.0.mlp.experts.down_proj_weight_scale").data_ptr() \
        - a.stored("embed_tokens.weight").untyped_storage().data_ptr()
    data = bytearray(written.read_bytes())
    data[offset] ^= 0x01
    written.write_bytes(bytes(data))
    _open_fails(written, "checksum mismatch", "layers.0.mlp.experts.down_proj_weight_scale")
    Artifact.open(written, verify=False)  # structure is fine; only verification catches it


def test_unknown_scheme(written: Path) -> None:
    _edit(written, lambda h, m: m["weights"]["norm.weight"].update(scheme="int3"))
    _open_fails(written, "unknown scheme 'int3'", "norm.weight")


def test_stored_dtype_disagrees_with_scheme(written: Path) -> None:
    name = "layers.0.mlp.gate_up_proj.weight_scale"
    _edit(written, lambda h, m: h[name].update(dtype="U8"))  # same size, wrong type
    _open_fails(written, "stored as U8 \\[6, 2\\], its scheme needs F8_E4M3 \\[6, 2\\]", name)


def test_stored_shape_disagrees_with_scheme(written: Path) -> None:
    name = "layers.0.mlp.experts.down_proj"
    _edit(written, lambda h, m: h[name].update(shape=[4, 2, 8]))  # same bytes, wrong shape
    _open_fails(written, "its scheme needs U8 \\[2, 4, 8\\]", name)


def test_missing_role_tensor(written: Path) -> None:
    name = "layers.0.mlp.gate_up_proj.weight_scale_2"
    _edit(written, lambda h, m: h.pop(name))
    _open_fails(written, "file lacks it", name)


def test_stray_tensor(written: Path) -> None:
    _edit(written, lambda h, m: m["weights"].pop("norm.weight"))
    _open_fails(written, "does not describe", "norm.weight")


# -- inspect ----------------------------------------------------------------------------------


def test_describe(written: Path) -> None:
    text = describe(written, verify=True)
    for fact in ("ninfer v1", "tiny_dense", "nvfp4", "random-init (seed 7)", "random weights",
                 "8 layers (6 GDN + 2 full attention)", "hidden 128", "4 q / 2 kv heads",
                 "dense, intermediate 256", "top_k=20",
                 "lm_head=bf16", "crc32, verified", f"{written.stat().st_size:,} bytes",
                 "groupwise-int: 1 weights"):
        assert fact in text, fact
    assert re.search(r"tokenizer +present", text) and re.search(r"chat template +present", text)
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert rows["layers.0.mlp.gate_up_proj.weight"][1:] == ["nvfp4", "6x32", "132",
                                                             f"{LONG_ERROR:.3e}"]
    assert rows["norm.weight"][1:] == ["bf16", "7", "14", "-"]
