"""Opens a `.ninfer` file: validate the header against the manifest, then memory-map the data.

Every check that can be made from the header runs before the file is mapped, so a truncated
or inconsistent file fails with an ArtifactError naming the tensor, never with a SIGBUS or a
shape error deep inside a kernel. Tensors are views of one private mapping of the whole file:
opening costs no copy, and pages are read on first touch.
"""

from __future__ import annotations

import json
import struct
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ninfer_runtime.artifact.format import (
    ALIGN,
    CHECKSUM_ALGORITHM,
    FORMAT,
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    METADATA_KEY,
    PAD_PREFIX,
    SAFETENSORS_DTYPES,
    TORCH_DTYPES,
    ArtifactError,
    StoredTensor,
    checksum,
)
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.quant import PackedWeight, Scheme, UnknownSchemeError, get_scheme, stored_name

MANIFEST_KEYS = ("weights_id", "config", "blobs", "weights", "tensors", "checksum_algorithm")


class Artifact:
    """A `.ninfer` file opened for reading; see `Artifact.open`."""

    def __init__(self, path: Path, manifest: dict[str, Any], tensors: dict[str, StoredTensor],
                 schemes: dict[str, Scheme], storage: torch.UntypedStorage, data_start: int):
        self.path = path
        self.manifest = manifest
        self._tensors = tensors  # every stored tensor the manifest describes (no pads)
        self._schemes = schemes  # logical weight -> scheme
        self._storage = storage
        self._data_start = data_start

    @classmethod
    def open(cls, path: str | Path, *, verify: bool = True) -> Artifact:
        """Validates and maps `path`; `verify` also checks every tensor's checksum (reads the
        whole file; measured 4-6 GB/s from the page cache)."""
        path = Path(path)
        try:
            size = path.stat().st_size
            header, data_start = _read_header(path, size)
        except OSError as e:
            raise ArtifactError(path, f"cannot read: {e.strerror or e}") from None
        manifest = _read_manifest(path, header)
        if data_start % ALIGN:
            raise ArtifactError(path, f"data section starts at byte {data_start}, not on a "
                                      f"{ALIGN}-byte boundary: not written by NInfer")
        tensors = {name: _parse_entry(path, name, entry) for name, entry in header.items()
                   if name != "__metadata__"}
        _check_bounds(path, tensors, size - data_start)
        schemes = _check_manifest(path, manifest, tensors)
        described = {n: t for n, t in tensors.items() if not n.startswith(PAD_PREFIX)}
        storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=size)
        artifact = cls(path, manifest, described, schemes, storage, data_start)
        if verify:
            artifact.verify()
        return artifact

    def _error(self, message: str, tensor: str | None = None) -> ArtifactError:
        return ArtifactError(self.path, message, tensor)

    def verify(self) -> None:
        """Recomputes every stored tensor's checksum; raises on the first mismatch."""
        for name, t in sorted(self._tensors.items(), key=lambda kv: kv[1].start):
            expected = self.manifest["tensors"][name]["checksum"]
            got = checksum(memoryview(self._bytes(t).numpy()))
            if got != expected:
                raise self._error(f"checksum mismatch (stored {expected}, computed {got}): "
                                  "the file is corrupt", name)

    # -- manifest -------------------------------------------------------------------------

    @cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.manifest["config"])

    @property
    def weights_id(self) -> str:
        return self.manifest["weights_id"]

    @property
    def generation_config(self) -> dict[str, Any]:
        return self.manifest.get("generation_config") or {}

    @property
    def chat_template(self) -> str | None:
        return self.manifest.get("chat_template")

    @property
    def tokenizer_json(self) -> str | None:
        if "tokenizer_json" not in self.manifest["blobs"]:
            return None
        return self.blob("tokenizer_json").decode("utf-8")

    # -- tensors --------------------------------------------------------------------------

    def _bytes(self, t: StoredTensor) -> torch.Tensor:
        return torch.tensor((), dtype=torch.uint8).set_(
            self._storage, self._data_start + t.start, (t.nbytes,))

    def stored(self, name: str) -> torch.Tensor:
        """The stored tensor `name` as a zero-copy view of the mapping (copy-on-write: writes to
        it never reach the file)."""
        t = self._tensors.get(name)
        if t is None:
            raise self._error("no such stored tensor", name)
        # open() checked the alignment, so the element offset is exact.
        offset = (self._data_start + t.start) // t.dtype.itemsize
        return torch.tensor((), dtype=t.dtype).set_(self._storage, offset, t.shape)

    def blob(self, name: str) -> bytes:
        stored = self.manifest["blobs"].get(name)
        if stored is None:
            raise self._error(f"no blob {name!r} (has: {sorted(self.manifest['blobs'])})")
        return self.stored(stored).numpy().tobytes()

    def weight_names(self) -> list[str]:
        return list(self.manifest["weights"])

    def weight(self, name: str) -> torch.Tensor | PackedWeight:
        """A plain weight as its tensor; a quantized one as a PackedWeight of its parts."""
        scheme = self._schemes.get(name)
        if scheme is None:
            raise self._error("no such weight", name)
        if not scheme.quantized:
            return self.stored(name)
        parts = {role: self.stored(stored_name(name, role)) for role in scheme.roles}
        return PackedWeight(scheme, parts, tuple(self.manifest["weights"][name]["shape"]))

    def weights(self) -> dict[str, torch.Tensor | PackedWeight]:
        return {name: self.weight(name) for name in self.manifest["weights"]}

    @property
    def nbytes(self) -> int:
        """File size in bytes."""
        return self._storage.nbytes()


# -- validation (module functions: each runs before the file is mapped) -----------------------


def _read_header(path: Path, size: int) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ArtifactError(path, f"not a safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ArtifactError(path, f"not a safetensors file (header length {n} does not fit "
                                      f"in {size} bytes): wrong file type or truncated")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ArtifactError(path, "not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise ArtifactError(path, "not a safetensors file (header is not a JSON object)")
    return header, 8 + n


def _read_manifest(path: Path, header: dict[str, Any]) -> dict[str, Any]:
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or METADATA_KEY not in meta:
        raise ArtifactError(path, "a safetensors file without NInfer metadata, not a .ninfer "
                                  "artifact (convert it with ninfer-convert)")
    try:
        manifest = json.loads(meta[METADATA_KEY])
    except (TypeError, json.JSONDecodeError) as e:
        raise ArtifactError(path, f"NInfer metadata is not JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(path, "NInfer metadata does not declare format 'ninfer'")
    found = manifest.get("format_version")
    if found != FORMAT_VERSION:
        raise ArtifactError(path, f"format version {found!r}; this NInfer reads version "
                                  f"{FORMAT_VERSION} (re-convert the model with this NInfer)")
    missing = [k for k in MANIFEST_KEYS if k not in manifest]
    if missing:
        raise ArtifactError(path, f"manifest lacks {missing}")
    malformed = [k for k in ("config", "blobs", "weights", "tensors")
                 if not isinstance(manifest[k], dict)]
    if malformed:
        raise ArtifactError(path, f"manifest entries {malformed} are not JSON objects")
    if manifest["checksum_algorithm"] != CHECKSUM_ALGORITHM:
        raise ArtifactError(path, f"checksum algorithm {manifest['checksum_algorithm']!r}; "
                                  f"this NInfer reads {CHECKSUM_ALGORITHM!r}")
    return manifest


def _parse_entry(path: Path, name: str, entry: Any) -> StoredTensor:
    try:
        dtype = TORCH_DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        start, end = (int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(path, f"malformed header entry {entry!r}", name) from None
    t = StoredTensor(name, dtype, shape, start)
    if min(shape, default=0) < 0 or end != t.end or start % dtype.itemsize:
        raise ArtifactError(path, f"header entry {entry!r} is inconsistent (negative dim, byte "
                                  "range not matching the shape, or misaligned)", name)
    return t


def _check_bounds(path: Path, tensors: dict[str, StoredTensor], data_size: int) -> None:
    ordered = sorted(tensors.values(), key=lambda t: t.end)
    beyond = [t for t in ordered if t.end > data_size and not t.name.startswith(PAD_PREFIX)]
    if beyond:
        t = beyond[0]
        raise ArtifactError(path, f"truncated file: the tensor's bytes end at data offset "
                                  f"{t.end} but the data section holds only {data_size} bytes",
                            t.name)
    end = ordered[-1].end if ordered else 0
    if end != data_size:
        raise ArtifactError(path, f"data section is {data_size} bytes, the header describes "
                                  f"{end}: the file was modified or is not whole")


def _check_manifest(path: Path, manifest: dict[str, Any],
                    tensors: dict[str, StoredTensor]) -> dict[str, Scheme]:
    """Every weight's role tensors and every blob exist with the scheme's dtype and shape, and
    every stored tensor is described and checksummed. Returns weight -> scheme."""
    schemes: dict[str, Scheme] = {}
    expected: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for name, info in manifest["weights"].items():
        try:
            scheme = get_scheme(info["scheme"])
            specs = scheme.stored_specs(tuple(info["shape"]))
            expected.update({stored_name(name, role): spec for role, spec in specs.items()})
        except UnknownSchemeError:
            raise ArtifactError(path, f"unknown scheme {info['scheme']!r}", name) from None
        except (KeyError, TypeError, ValueError) as e:
            raise ArtifactError(path, f"bad weight entry {info!r}: {e}", name) from None
        schemes[name] = scheme
    for stored in manifest["blobs"].values():  # a blob is its bytes, whatever their number
        expected[stored] = (torch.uint8, (tensors[stored].nbytes,) if stored in tensors else ())
    for name, (dtype, shape) in expected.items():
        t = tensors.get(name)
        if t is None:
            raise ArtifactError(path, "missing: the manifest describes it, the file lacks it",
                                name)
        if t.dtype != dtype or t.shape != tuple(shape):
            raise ArtifactError(path, f"stored as {SAFETENSORS_DTYPES[t.dtype]} {list(t.shape)}, "
                                      f"its scheme needs {SAFETENSORS_DTYPES[dtype]} "
                                      f"{list(shape)}", name)
    stray = [n for n in tensors if n not in expected and not n.startswith(PAD_PREFIX)]
    if stray:
        raise ArtifactError(path, "stored tensor that the manifest does not describe", stray[0])
    checksums = manifest["tensors"]
    for name in expected:
        if not isinstance(checksums.get(name), dict) or "checksum" not in checksums[name]:
            raise ArtifactError(path, "no checksum in the manifest", name)
    return schemes
