"""Writes a `.ninfer` file: plan the whole layout, stream tensors, then commit atomically.

The layout (every tensor's dtype, shape and offset) follows from the weight specs alone, so the
header's size is known before any data exists. Only the checksums (fixed width) and the
quantization errors (room reserved) are filled in at the end. Tensors go straight to their
final offsets with plain file writes, so memory stays at one tensor however large the model.
The file is written as `<path>.tmp-<pid>` and renamed only once complete and synced.
"""

from __future__ import annotations

import math
import os
import struct
import weakref
from collections import Counter
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import IO, Any

import torch

from ninfer_runtime.artifact.format import (
    ALIGN,
    CHECKSUM_ALGORITHM,
    CHECKSUM_PLACEHOLDER,
    FLOAT_REPR_MAX,
    FORMAT,
    FORMAT_VERSION,
    MAX_HEADER_BYTES,
    PAD_PREFIX,
    ArtifactError,
    Shape,
    StoredTensor,
    WeightSpec,
    align_up,
    blob_tensor_name,
    checksum,
    encode_header,
    plan_layout,
    tensor_bytes,
)
from ninfer_runtime.quant import WEIGHTS_IDS, UnknownSchemeError, get_scheme, stored_name

SOURCE_KINDS = ("hub", "local", "random-init")
# The manifest keys a caller provides; the writer adds the rest (layout, checksums, version).
REQUIRED_KEYS = ("weights_id", "source", "config")
OPTIONAL_KEYS: dict[str, Any] = {  # with their defaults; random_init defaults to the source kind
    "profile": None, "random_init": None, "generation_config": {}, "chat_template": None,
    "options": {},
    "dflash": None,  # the DFlash draft packed under dflash.* (models.dflash.DFlashConfig)
    "draft_head": None,  # how draft_head.token_ids were chosen (--lm-head-draft)
}


def _first_duplicate(names: list[str]) -> str | None:
    return next((n for n, count in Counter(names).items() if count > 1), None)


def _discard(file: IO[bytes], path: Path) -> None:
    file.close()
    path.unlink(missing_ok=True)


def _ninfer_version() -> str:
    """The installed ninfer-runtime version; "source" when run from a source tree on the
    Python path without installing (as on the GPU machine)."""
    try:
        return version("ninfer-runtime")
    except PackageNotFoundError:
        return "source"


class ArtifactWriter:
    """Context manager writing one `.ninfer` file.

    ```
    with ArtifactWriter(path, manifest, weights, {"tokenizer_json": len(data)}) as w:
        w.write_weight("embed_tokens.weight", {"weight": t})
        ...
        w.write_blob("tokenizer_json", data)
    ```
    Leaving the block normally calls `close()` (which fails if anything planned is missing);
    an exception, KeyboardInterrupt included, removes the temp file, and so does dropping a
    writer that was never closed. Tensors may be written in any order.
    """

    def __init__(self, path: str | Path, manifest: dict[str, Any], weights: list[WeightSpec],
                 blobs: dict[str, int]):
        self.path = Path(path)
        self.tmp_path = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        self._manifest = self._caller_manifest(manifest)
        self._weights = {w.name: w for w in weights}
        dup = _first_duplicate([w.name for w in weights])
        if dup is not None:
            raise self._error("weight planned twice", dup)
        self._roles = {w.name: self._plan_roles(w) for w in weights}
        self._blobs = {name: blob_tensor_name(name) for name in blobs}
        self._layout = plan_layout(self._plan_tensors(blobs))
        self._tensors = {t.name: t for t in self._layout if not t.name.startswith(PAD_PREFIX)}
        self._checksums: dict[str, str] = {}
        self._errors: dict[str, float | None] = {}
        self._created = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self._header_size = self._reserve_header()
        self._data_start = 8 + self._header_size
        self._closed = False
        self._file = open(self.tmp_path, "wb")  # noqa: SIM115 (lives until close/abort)
        self._finalizer = weakref.finalize(self, _discard, self._file, self.tmp_path)
        data_end = self._layout[-1].end if self._layout else 0
        self._file.truncate(self._data_start + data_end)  # gaps (pads) read back as zeros

    # -- planning -------------------------------------------------------------------------

    def _error(self, message: str, tensor: str | None = None) -> ArtifactError:
        return ArtifactError(self.path, message, tensor)

    def _caller_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        allowed = (*REQUIRED_KEYS, *OPTIONAL_KEYS)
        unknown = sorted(set(manifest) - set(allowed))
        if unknown:
            raise self._error(f"manifest keys {unknown} are not the caller's to set "
                              f"(allowed: {', '.join(allowed)})")
        missing = [k for k in REQUIRED_KEYS if k not in manifest]
        if missing:
            raise self._error(f"manifest lacks {missing}")
        out = {**OPTIONAL_KEYS, **manifest}
        if out["weights_id"] not in WEIGHTS_IDS:
            raise self._error(f"weights_id {out['weights_id']!r} is not one of {WEIGHTS_IDS}")
        source = out["source"]
        if not isinstance(source, dict) or source.get("kind") not in SOURCE_KINDS:
            raise self._error(f"source {source!r} needs a kind in {SOURCE_KINDS}")
        if not isinstance(out["config"], dict):
            raise self._error("config must be the Hugging Face config dict")
        if out["random_init"] is None:
            out["random_init"] = source["kind"] == "random-init"
        return out

    def _plan_roles(self, w: WeightSpec) -> dict[str, tuple[str, torch.dtype, Shape]]:
        if w.name.startswith("__"):
            raise self._error("names starting with '__' are reserved for the format", w.name)
        try:
            specs = get_scheme(w.scheme).stored_specs(tuple(w.shape))
            return {role: (stored_name(w.name, role), dtype, shape)
                    for role, (dtype, shape) in specs.items()}
        except (UnknownSchemeError, ValueError) as e:
            raise self._error(str(e), w.name) from None

    def _plan_tensors(self, blobs: dict[str, int]) -> list[tuple[str, torch.dtype, Shape]]:
        """Every stored tensor in write order: the weights' roles, then the blobs."""
        planned = [spec for roles in self._roles.values() for spec in roles.values()]
        for name, n in blobs.items():
            if not isinstance(n, int) or n < 0:
                raise self._error(f"blob size {n!r} is not a byte count", self._blobs[name])
            planned.append((self._blobs[name], torch.uint8, (n,)))
        dup = _first_duplicate([name for name, _, _ in planned])
        if dup is not None:
            raise self._error("two weights store a tensor under this name", dup)
        return planned

    def _manifest_now(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, **self._manifest,
            "blobs": self._blobs,
            "weights": {n: {"scheme": w.scheme, "shape": list(w.shape),
                            "error": self._errors.get(n)} for n, w in self._weights.items()},
            "tensors": {n: {"checksum": self._checksums.get(n, CHECKSUM_PLACEHOLDER)}
                        for n in self._tensors},
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "created": self._created,
            "ninfer_version": _ninfer_version(),
        }

    def _encode_header(self) -> bytes:
        try:
            return encode_header(self._manifest_now(), self._layout)
        except (TypeError, ValueError) as e:
            raise self._error(f"manifest is not plain JSON: {e}") from None

    def _reserve_header(self) -> int:
        """Header bytes to reserve: the placeholder header plus room for every weight's error
        to grow from `null` to the longest float, rounded so the data section starts aligned."""
        size = len(self._encode_header()) + (FLOAT_REPR_MAX - len("null")) * len(self._weights)
        size = align_up(8 + size, ALIGN) - 8
        if size > MAX_HEADER_BYTES:
            raise self._error(f"header of {size} bytes exceeds safetensors' {MAX_HEADER_BYTES}")
        return size

    # -- writing --------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise self._error("the writer is already closed")

    def _write(self, t: StoredTensor, data: memoryview) -> None:
        self._file.seek(self._data_start + t.start)
        self._file.write(data)
        self._checksums[t.name] = checksum(data)

    def write_weight(self, name: str, parts: dict[str, torch.Tensor],
                     error: float | None = None) -> None:
        """Writes every stored tensor of one logical weight (`parts`: role -> tensor)."""
        self._check_open()
        roles = self._roles.get(name)
        if roles is None:
            raise self._error("weight is not in the plan", name)
        if name in self._errors:
            raise self._error("weight written twice", name)
        if set(parts) != set(roles):
            raise self._error(f"got roles {sorted(parts)}, scheme {self._weights[name].scheme} "
                              f"stores {sorted(roles)}", name)
        if error is not None and not (isinstance(error, (int, float)) and math.isfinite(error)):
            raise self._error(f"quantization error {error!r} is not a finite number", name)
        for role, (sname, dtype, shape) in roles.items():
            t = parts[role]
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise self._error(f"got {t.dtype} {list(t.shape)}, the plan says {dtype} "
                                  f"{list(shape)}", sname)
        for role, (sname, _, _) in roles.items():
            self._write(self._tensors[sname], tensor_bytes(parts[role]))
        self._errors[name] = None if error is None else float(error)

    def write_blob(self, name: str, data: bytes) -> None:
        self._check_open()
        sname = self._blobs.get(name)
        if sname is None:
            raise self._error(f"blob {name!r} is not in the plan")
        if sname in self._checksums:
            raise self._error("blob written twice", sname)
        planned = self._tensors[sname]
        if len(data) != planned.nbytes:
            raise self._error(f"blob has {len(data)} bytes, the plan says {planned.nbytes}", sname)
        self._write(planned, memoryview(data))

    def close(self) -> None:
        """Checks that everything planned was written, writes the final header, syncs and
        renames into place. Calling it again after success does nothing."""
        if self._closed:
            return
        try:
            missing = [n for n in self._tensors if n not in self._checksums]
            if missing:
                raise self._error(f"{len(missing)} planned tensors were never written, "
                                  f"first: {missing[:3]}", missing[0])
            header = self._encode_header()
            if len(header) > self._header_size:
                raise self._error("header outgrew its reserved size (a bug in NInfer)")
            self._file.seek(0)
            self._file.write(struct.pack("<Q", self._header_size))
            self._file.write(header.ljust(self._header_size, b" "))
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._finalizer.detach()
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drops the partial file; the final path is never touched."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> ArtifactWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _fsync_dir(directory: Path) -> None:
    """Makes the rename itself durable (POSIX); a no-op where directories cannot be opened."""
    if os.name != "posix":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
