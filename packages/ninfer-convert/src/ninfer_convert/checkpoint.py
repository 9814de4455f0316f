"""The tensors of a Hugging Face checkpoint directory, read shard by shard with plain file reads.

Only the safetensors headers are read up front. A tensor's bytes are read on demand with
seek + readinto into a fresh buffer: with mmap (safetensors.safe_open) every page touched stays
in the process RSS until the mapping goes away, so converting a 54 GB checkpoint would look like
a 54 GB process; with reads, memory holds only the tensors being converted.

A ModelOpt NVFP4 export stores each quantized linear `X.weight` as `X.weight` (uint8, two E2M1
codes per byte), `X.weight_scale` (float8_e4m3fn per 16 inputs) and `X.weight_scale_2` (fp32
scalar), plus `X.input_scale` for activations. `Checkpoint` presents such a triple as one logical
tensor `X.weight` of the unpacked shape with the "nvfp4" layout, and hides the scale tensors, so
the name mapping sees the same names as in a BF16 checkpoint.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

INDEX_FILE = "model.safetensors.index.json"
HEADER_LIMIT = 100_000_000  # safetensors' own limit on the JSON header
DTYPES: dict[str, torch.dtype] = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "F8_E4M3": torch.float8_e4m3fn,
}
# Companions of a ModelOpt-quantized `X.weight`; none is a tensor of the model itself.
MODELOPT_AUX_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".k_scale",
                         ".v_scale")

Layout = Literal["plain", "nvfp4"]


class ConvertError(Exception):
    """Any input the converter refuses; the message names the file or tensor at fault."""


class CheckpointError(ConvertError):
    """A checkpoint directory whose files or tensors cannot be read as needed."""


def torch_dtype(tag: str, tensor: str, file: Path | str) -> torch.dtype:
    """The torch dtype of a safetensors dtype tag, or an error naming the tensor."""
    try:
        return DTYPES[tag]
    except KeyError:
        raise CheckpointError(
            f"{file}: tensor {tensor!r} has dtype {tag}, which the converter does not read "
            f"(supported: {', '.join(DTYPES)})"
        ) from None


@dataclass(frozen=True)
class FileTensor:
    """One tensor as stored in a shard: where its bytes lie and how to interpret them."""

    name: str
    file: Path
    dtype_tag: str  # the safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_tag, self.name, self.file)


@dataclass(frozen=True)
class SourceTensor:
    """A logical source tensor: `shape` is the unpacked [..., out, in] shape for "nvfp4".

    The dtype is checked only when asked for, so a checkpoint may carry tensors of other dtypes
    that the conversion does not use.
    """

    name: str
    shape: tuple[int, ...]
    dtype_tag: str  # safetensors dtype of the stored values ("U8" for "nvfp4")
    layout: Layout
    nbytes: int  # bytes read to load it, companions included
    origin: str  # the file it lives in, or what generates it (for messages)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_tag, self.name, self.origin)


def read_header(path: Path) -> dict[str, FileTensor]:
    """The tensors of one safetensors file, from its header only."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8).ljust(8, b"\0"))
            if not 0 < n <= min(HEADER_LIMIT, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: not a safetensors file (header is not an object)")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise CheckpointError(f"{path}: not a safetensors file (header is not JSON)") from None
    data_start = 8 + n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            (begin, end), shape, tag = entry["data_offsets"], tuple(entry["shape"]), entry["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: malformed header entry for tensor {name!r}") from None
        if tag in DTYPES and end - begin != math.prod(shape) * DTYPES[tag].itemsize:
            raise CheckpointError(
                f"{path}: tensor {name!r}: {end - begin} bytes do not hold {tag} {list(shape)}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: tensor {name!r} lies past the end of the file (truncated shard?)"
            )
        tensors[name] = FileTensor(name, path, tag, shape, data_start + begin, end - begin)
    return tensors


def read_tensor(t: FileTensor) -> torch.Tensor:
    """Reads one tensor's bytes into a new CPU tensor of its dtype and shape."""
    buf = torch.empty(t.nbytes, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    with open(t.file, "rb", buffering=0) as f:
        f.seek(t.offset)
        done = 0
        while done < t.nbytes:  # one read returns at most ~2 GiB on Linux
            n = f.readinto(view[done:])
            if not n:
                raise CheckpointError(f"{t.file}: tensor {t.name!r} is truncated")
            done += n
    return buf.view(t.dtype).reshape(t.shape)


def index_shards(directory: Path) -> dict[str, FileTensor]:
    """All tensors of a checkpoint directory: the shards its index names, or every *.safetensors
    file when there is no index."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise CheckpointError(f"{index}: not a safetensors index (no weight_map)") from None
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (directory / f).is_file()]
        if missing:
            raise CheckpointError(
                f"{index} names the shard {missing[0]!r}, which is missing from {directory}"
            )
    else:
        files = sorted(p.name for p in directory.glob("*.safetensors"))
        weight_map = {}
    if not files:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    tensors: dict[str, FileTensor] = {}
    for file in files:
        for name, t in read_header(directory / file).items():
            if name in tensors:
                raise CheckpointError(
                    f"{directory}: tensor {name!r} is in both {tensors[name].file.name} and {file}"
                )
            tensors[name] = t
    for name, file in weight_map.items():
        if name not in tensors or tensors[name].file.name != file:
            raise CheckpointError(
                f"{index} places tensor {name!r} in {file}, whose header lacks it"
            )
    return tensors


class Checkpoint:
    """The logical tensors of a checkpoint directory; `nvfp4` reads ModelOpt NVFP4 triples."""

    def __init__(self, directory: Path, *, nvfp4: bool = False):
        self.directory = directory
        self._files = index_shards(directory)
        self.tensors: dict[str, SourceTensor] = {}
        for name, t in self._files.items():
            if nvfp4 and name.endswith(MODELOPT_AUX_SUFFIXES):
                continue
            if name.endswith(".pre_quant_scale"):
                raise CheckpointError(
                    f"{t.file}: tensor {name!r}: activation-aware (AWQ) scales are not supported"
                )
            if nvfp4 and f"{name}_scale" in self._files:
                self.tensors[name] = self._packed(name)
            else:
                self.tensors[name] = SourceTensor(name, t.shape, t.dtype_tag, "plain", t.nbytes,
                                                  str(t.file))

    def _packed(self, name: str) -> SourceTensor:
        w = self._files[name]
        for role in ("_scale", "_scale_2"):
            if f"{name}{role}" not in self._files:
                raise CheckpointError(
                    f"{self.directory}: NVFP4 weight {name!r} lacks its {name}{role} tensor"
                )
        scale, scale_2 = self._files[f"{name}_scale"], self._files[f"{name}_scale_2"]
        *lead, half = w.shape
        if (w.dtype_tag, scale.dtype_tag, scale_2.dtype_tag) != ("U8", "F8_E4M3", "F32") \
                or scale.shape != (*lead, half // 8) or math.prod(scale_2.shape) != 1:
            raise CheckpointError(
                f"{w.file}: tensor {name!r} is not a ModelOpt NVFP4 weight (expected uint8 "
                f"[out, in/2] with float8_e4m3fn [out, in/16] scales and an fp32 scalar scale_2; "
                f"got {w.dtype_tag} {list(w.shape)}, {scale.dtype_tag} {list(scale.shape)}, "
                f"{scale_2.dtype_tag} {list(scale_2.shape)})"
            )
        return SourceTensor(name, (*lead, half * 2), "U8", "nvfp4",
                            w.nbytes + scale.nbytes + scale_2.nbytes, str(w.file))

    def load(self, name: str) -> dict[str, torch.Tensor]:
        """The tensor's stored parts by role: {"weight"} for plain, the three NVFP4 roles with
        `weight_scale_2` as a 0-d fp32 tensor for "nvfp4"."""
        t = self.tensors[name]
        if t.layout == "plain":
            return {"weight": read_tensor(self._files[name])}
        return {
            "weight": read_tensor(self._files[name]),
            "weight_scale": read_tensor(self._files[f"{name}_scale"]),
            "weight_scale_2": read_tensor(self._files[f"{name}_scale_2"]).reshape(()),
        }
