"""Converts a `ModelSource` into a `.ninfer` artifact, one output tensor at a time.

`plan_outputs` decides everything up front from headers alone: which NInfer tensors exist
(`mapping.plan_tensors`), their shapes, their storage scheme, and whether every source can be
read, so bad input fails before a byte is written. `build` then streams: for each output it
reads only its sources, combines them (concatenated rows, stacked experts, squeezed conv),
casts or quantizes, writes, and frees, so peak memory is a few times the largest tensor.

A DFlash draft (`source.dflash`, ninfer_convert.dflash) and a draft head (`source.draft_vocab`,
ninfer_convert.draft_vocab) add their outputs after the target's, read from the same merged
store (`source_store`), planned and checked the same way.

Quantization applies to the combined tensor as NInfer stores it, so a fused-expert checkpoint
and a per-expert one give identical artifacts. A ModelOpt NVFP4 export is imported as it is
when the target is nvfp4 (packed codes and block scales concatenated, each source's scalar
global scale repeated over its rows); its tensors are dequantized when the target is bf16;
re-quantizing them to groupwise-int is refused (it would stack two quantization errors).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from ninfer_convert import dflash, draft_vocab
from ninfer_convert.checkpoint import ConvertError, SourceTensor
from ninfer_convert.mapping import TensorPlan, lm_head_source, plan_tensors
from ninfer_convert.quantize import quantize
from ninfer_convert.sources import MergedStore, ModelSource, TensorStore, hf_layout
from ninfer_runtime.artifact import ArtifactWriter, WeightSpec
from ninfer_runtime.config import ModelConfig
from ninfer_runtime.quant import WEIGHTS_IDS, Scheme, get_scheme

Shape = tuple[int, ...]
Choice = Literal["body", "bf16"]
PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}
ERROR_CHUNK_ELEMS = 1 << 20  # elements per slice when measuring the quantization error


class PlanError(ConvertError):
    """The source cannot give the tensors the config needs (missing, wrong shape or dtype)."""


class OutputPathError(ConvertError):
    """The artifact cannot be written where asked."""


@dataclass(frozen=True)
class BuildOptions:
    weights: str = "bf16"  # the weights id: bf16, groupwise-int or nvfp4
    lm_head: Choice = "body"  # "body": quantized like the body; "bf16": kept in bf16
    mtp: Choice = "body"
    include_mtp: bool = True
    include_vision: bool = True
    # Where quantization runs. Recorded in the manifest: nvfp4 bytes may differ in the last
    # bit between CPU and CUDA (each matches ModelOpt run on the same device).
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.weights not in WEIGHTS_IDS:
            raise ConvertError(f"unknown weights id {self.weights!r} (known: "
                               f"{', '.join(WEIGHTS_IDS)})")

    def manifest(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "weights"}


@dataclass(frozen=True)
class OutputTensor:
    """One NInfer weight to write: how to build it, its logical shape and storage scheme."""

    plan: TensorPlan
    shape: Shape
    scheme: str
    sources: tuple[SourceTensor, ...]

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def nbytes_in(self) -> int:
        return sum(s.nbytes for s in self.sources)

    @property
    def imported(self) -> bool:
        """True when ModelOpt NVFP4 parts are copied through as they are."""
        return self.scheme == "nvfp4" and self.sources[0].layout == "nvfp4"


def choose_scheme(plan: TensorPlan, options: BuildOptions) -> str:
    if plan.group in ("fp32", "int64"):
        return plan.group
    if not plan.quantizable:
        return "bf16"
    choice = {"lm_head": options.lm_head, "mtp": options.mtp}.get(plan.group, "body")
    return options.weights if choice == "body" else "bf16"


def _slots(plan: TensorPlan, shapes: Sequence[Shape]) -> list[tuple[int | None, int, int]]:
    """Where each source of a concat/stack lands: (expert or None, first row, end row), rows
    counted along dim -2 (the output dim) of the combined tensor or of its expert."""
    group = {"concat": len(shapes), "stack_concat": plan.parts}.get(plan.combine, 1)
    slots: list[tuple[int | None, int, int]] = []
    for k, shape in enumerate(shapes):
        row = 0 if k % group == 0 else slots[-1][2]
        slots.append((None if plan.combine == "concat" else k // group, row, row + shape[-2]))
    return slots


def combined_shape(plan: TensorPlan, sources: Sequence[SourceTensor]) -> Shape:
    """The shape of the NInfer tensor built from `sources`, checking they fit together."""
    shapes = [s.shape for s in sources]
    first = shapes[0]
    if plan.combine == "one":
        return first
    if plan.combine == "squeeze1":
        if len(first) != 3 or first[1] != 1:
            raise PlanError(f"{sources[0].origin}: tensor {sources[0].name!r} has shape "
                            f"{list(first)}, expected [channels, 1, kernel]")
        return (first[0], first[2])
    slots = _slots(plan, shapes)
    ends = {end for k, (_, _, end) in enumerate(slots)
            if k + 1 == len(slots) or slots[k + 1][1] == 0}  # the rows of each expert
    if len(ends) > 1 or any(len(s) < 2 or s[:-2] + s[-1:] != first[:-2] + first[-1:]
                            for s in shapes):
        listing = ", ".join(f"{s.name} {list(s.shape)}" for s in sources[:4])
        raise PlanError(f"{sources[0].origin}: cannot {plan.combine} the sources of "
                        f"{plan.name!r}, their shapes differ ({listing}, ...)")
    if plan.combine == "concat":
        return (*first[:-2], slots[-1][2], first[-1])
    return (slots[-1][0] + 1, *first[:-2], slots[-1][2], first[-1])


def expected_shapes(cfg: ModelConfig, options: BuildOptions) -> dict[str, Shape]:
    """The output shapes the config implies, from the checkpoint layout it describes."""
    layout = hf_layout(cfg)
    fake = {n: SourceTensor(n, shape, tag, "plain", 0, "config") for n, (shape, tag)
            in layout.items()}
    plans = plan_tensors(cfg, set(layout), include_mtp=options.include_mtp,
                         include_vision=options.include_vision)
    return {p.name: combined_shape(p, [fake[s] for s in p.sources]) for p in plans}


def source_store(source: ModelSource) -> TensorStore:
    """Every tensor the build reads: the target's under their names, the DFlash draft's under
    "dflash:", the draft head's (ids and lm_head rows) under "draft_head:"."""
    stores: dict[str, TensorStore] = {"": source.store}
    if source.dflash is not None:
        stores[dflash.STORE_PREFIX] = source.dflash.store
    if source.draft_vocab is not None:
        try:
            head = source.store.tensors[lm_head_source(set(source.store.tensors))]
        except KeyError as e:
            raise PlanError(f"{source.where}: the checkpoint lacks the tensor {e.args[0]!r}, "
                            "which the config requires") from None
        stores[draft_vocab.STORE_PREFIX] = draft_vocab.DraftHeadStore(
            source.draft_vocab, head, source.store.load)
    return MergedStore(stores)


def _extra_plans(source: ModelSource) -> list[TensorPlan]:
    """The draft's and the draft head's outputs; raises PlanError when the draft lacks a
    tensor its config requires or has one of another shape."""
    plans: list[TensorPlan] = []
    if source.dflash is not None:
        draft = source.dflash
        for name, (shape, _) in draft.layout().items():
            t = draft.store.tensors.get(name)
            if t is None:
                raise PlanError(f"{draft.where}: the DFlash draft lacks the tensor {name!r}, "
                                "which its config requires")
            if t.shape != shape:
                raise PlanError(f"{t.origin}: DFlash tensor {name!r} has shape "
                                f"{list(t.shape)}, its config implies {list(shape)}")
        plans += draft.plans()
    if source.draft_vocab is not None:
        plans += source.draft_vocab.plans()
    return plans


def _check_source(t: SourceTensor, scheme: str) -> None:
    dtype = t.dtype  # raises for dtypes the converter cannot read
    if t.layout == "plain" and not dtype.is_floating_point and scheme != "int64":
        raise PlanError(f"{t.origin}: tensor {t.name!r} is {dtype} but not an NVFP4 weight "
                        "(no weight_scale next to it)")
    if t.layout == "nvfp4" and scheme == "groupwise-int":
        raise PlanError(f"{t.origin}: tensor {t.name!r} is NVFP4-quantized; re-quantizing it to "
                        "groupwise-int would stack two quantization errors (use --weights nvfp4 "
                        "or bf16, or convert the BF16 release)")


def plan_outputs(source: ModelSource, options: BuildOptions) -> list[OutputTensor]:
    """Every output tensor with its shape and scheme; raises PlanError before any work if the
    source cannot provide them."""
    cfg = source.config
    try:
        plans = plan_tensors(cfg, set(source.store.tensors), include_mtp=options.include_mtp,
                             include_vision=options.include_vision)
    except KeyError as e:
        raise PlanError(f"{source.where}: the checkpoint lacks the tensor {e.args[0]!r}, which "
                        "its config requires") from None
    plans += _extra_plans(source)
    expected = expected_shapes(cfg, options)
    tensors = source_store(source).tensors
    outputs = []
    for plan in plans:
        sources = tuple(tensors[s] for s in plan.sources)
        scheme = choose_scheme(plan, options)
        for t in sources:
            _check_source(t, scheme)
        if scheme == "nvfp4" and len({t.layout for t in sources}) > 1:
            raise PlanError(f"{source.where}: the sources of {plan.name!r} mix NVFP4 and "
                            "unquantized tensors")
        shape = combined_shape(plan, sources)
        if plan.name in expected and expected[plan.name] != shape:
            raise PlanError(f"{source.where}: {plan.name!r} built from {plan.sources[0]!r}... has "
                            f"shape {list(shape)}, the config implies {list(expected[plan.name])}")
        try:
            get_scheme(scheme).stored_specs(shape)
        except ValueError as e:
            raise PlanError(f"{plan.name!r}: {e}") from None
        outputs.append(OutputTensor(plan, shape, scheme, sources))
    return outputs


def _packed_parts(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ModelOpt triple in NInfer's nvfp4 layout: the scalar global scale repeated per row."""
    rows = packed["weight"].shape[:-1]
    return {**packed, "weight_scale_2": packed["weight_scale_2"].float().expand(rows)}


def _compute_dtype(sources: Sequence[SourceTensor]) -> torch.dtype:
    """bf16 when every source is bf16 (quantizers see the checkpoint's exact values), else fp32
    (exact for fp16, fp8 and dequantized NVFP4)."""
    if all(s.layout == "plain" and s.dtype == torch.bfloat16 for s in sources):
        return torch.bfloat16
    return torch.float32


def relative_error(w: torch.Tensor, parts: dict[str, torch.Tensor], scheme: Scheme) -> float:
    """||W - dequant(parts)|| / ||W||, over slices of dim 0 to bound the temporaries (fp32
    differences, fp64 sums)."""
    num = den = 0.0
    step = max(1, ERROR_CHUNK_ELEMS // max(1, w[0].numel()))
    for i in range(0, w.shape[0], step):
        ref = w[i:i + step].float()  # may be a view of w: never modified in place
        deq = scheme.dequantize_parts({k: v[i:i + step] for k, v in parts.items()})
        den += float(ref.square().sum(dtype=torch.float64))
        num += float(deq.sub_(ref).square_().sum(dtype=torch.float64))
    return math.sqrt(num / den) if den else math.sqrt(num)


Loader = Callable[[str], dict[str, torch.Tensor]]
Roles = dict[str, tuple[torch.dtype, Shape, int]]  # role -> (dtype, shape, row dim)


def _assemble(out: OutputTensor, load: Loader, roles: Roles,
              prepare: Callable[[SourceTensor, dict[str, torch.Tensor]],
                                dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The output's roles, each source loaded in turn (`prepare` maps its parts to the roles)
    and copied into its rows / expert, so memory holds the output plus one source."""
    if out.plan.combine in ("one", "squeeze1"):
        parts = prepare(out.sources[0], load(out.sources[0].name))
        squeeze = out.plan.combine == "squeeze1"
        return {role: (parts[role].squeeze(1) if squeeze else parts[role]).to(dtype)
                for role, (dtype, _, _) in roles.items()}
    result: dict[str, torch.Tensor] = {}
    slots = _slots(out.plan, [s.shape for s in out.sources])
    for (expert, start, end), source in zip(slots, out.sources, strict=True):
        parts = prepare(source, load(source.name))
        if not result:  # on the sources' device: a random-init build draws them on the GPU
            device = next(iter(parts.values())).device
            result = {role: torch.empty(shape, dtype=dtype, device=device)
                      for role, (dtype, shape, _) in roles.items()}
        for role, (_, _, row_dim) in roles.items():
            dst = result[role] if expert is None else result[role][expert]
            dst.narrow(row_dim, start, end - start).copy_(parts[role])
        del parts
    return result


def _values(source: SourceTensor, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A source's values: as stored, or dequantized (fp32) for a ModelOpt NVFP4 weight."""
    if source.layout == "plain":
        return parts
    return {"weight": get_scheme("nvfp4").dequantize_parts(_packed_parts(parts))}


def convert_tensor(out: OutputTensor, load: Loader,
                   device: str = "cpu") -> tuple[dict[str, torch.Tensor], float | None]:
    """The stored parts of one output and its quantization error (None when not quantized).
    `load(name)` reads one source tensor's parts."""
    scheme = get_scheme(out.scheme)
    if out.imported:
        roles = {role: (dtype, shape, -1 if role == "weight_scale_2" else -2)
                 for role, (dtype, shape) in scheme.stored_specs(out.shape).items()}
        return _assemble(out, load, roles, lambda _, parts: _packed_parts(parts)), None
    if not scheme.quantized:
        roles = {"weight": (PLAIN_DTYPES[out.scheme], out.shape, -2)}
        return _assemble(out, load, roles, _values), None
    roles = {"weight": (_compute_dtype(out.sources), out.shape, -2)}
    w = _assemble(out, load, roles, _values)["weight"].to(device)
    try:
        parts = quantize(out.scheme, w)
    except ValueError as e:  # e.g. inf or NaN weights
        raise ConvertError(f"cannot quantize {out.name!r} to {out.scheme}: {e}") from None
    error = relative_error(w, parts, scheme)
    return {k: v.cpu() for k, v in parts.items()}, error


def check_output_path(path: Path) -> None:
    """Fails early (before any download or conversion) when `path` cannot be written; creates
    nothing (`build` makes missing parent directories)."""
    if path.is_dir():
        raise OutputPathError(f"{path}: is a directory; give the artifact's file name")
    existing = path.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"{path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise OutputPathError(f"{path}: {existing} is not writable")


def manifest(source: ModelSource, options: BuildOptions) -> dict[str, Any]:
    opts = options.manifest()
    if source.quantized:
        opts["imported_from"] = source.quantized
    return {
        "profile": source.profile,
        "weights_id": options.weights,
        "source": source.origin,
        "random_init": source.random_init,
        "config": source.hf_config,
        "generation_config": source.generation_config,
        "chat_template": source.chat_template,
        "options": opts,
        "dflash": None if source.dflash is None else source.dflash.manifest(),
        "draft_head": None if source.draft_vocab is None else source.draft_vocab.record,
    }


def build(source: ModelSource, path: Path, options: BuildOptions,
          on_progress: Callable[[int], None] | None = None,
          outputs: list[OutputTensor] | None = None) -> Path:
    """Writes the artifact at `path` (atomically: on any failure nothing is left there).

    `on_progress(n)` is called with the source bytes consumed after each tensor; `outputs`
    (from `plan_outputs`) may be passed when the caller planned already.
    """
    outputs = plan_outputs(source, options) if outputs is None else outputs
    check_output_path(path)
    blobs = {}
    if source.tokenizer_json is not None:
        blobs["tokenizer_json"] = source.tokenizer_json.encode()
    specs = [WeightSpec(o.name, o.scheme, o.shape) for o in outputs]
    store = source_store(source)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        writer = ArtifactWriter(path, manifest(source, options), specs,
                                {k: len(v) for k, v in blobs.items()})
    except OSError as e:
        raise OutputPathError(f"{path}: cannot write: {e.strerror or e}") from None
    with writer, torch.no_grad():
        for name, data in blobs.items():
            writer.write_blob(name, data)
        for out in outputs:
            parts, error = convert_tensor(out, store.load, options.device)
            writer.write_weight(out.name, parts, error)
            del parts
            if on_progress is not None:
                on_progress(out.nbytes_in)
    return path
