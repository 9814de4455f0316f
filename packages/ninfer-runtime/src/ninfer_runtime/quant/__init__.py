"""Weight storage schemes: how a logical weight is stored as one or more tensors.

A logical weight `P.weight` of shape [..., out, in] stored under scheme S is the set of tensors
`P.<role>` for each role of S (role "weight" is the logical name itself). Dequantization here is
the plain torch reference every kernel is tested against; quantization lives in ninfer-convert.

| scheme          | roles and stored layout                                                     |
|-----------------|-----------------------------------------------------------------------------|
| bf16            | weight: bf16 [..., out, in]                                                 |
| fp32            | weight: fp32 (A_log, dt_bias)                                               |
| int64           | weight: int64 (not a weight: token ids, e.g. the draft head's vocabulary)   |
| nvfp4           | weight: uint8 [..., out, in/2] (two E2M1 codes per byte, ModelOpt order);   |
|                 | weight_scale: float8_e4m3fn [..., out, in/16]; weight_scale_2: fp32 [..., out] |
|                 | (the per-tensor global scale, repeated per output row so fused tensors keep  |
|                 | each source's own scale)                                                    |
| groupwise-int   | weight: uint8 [..., out, in/2] (two uint4 codes per byte);                  |
|                 | weight_scale: bf16 [..., out, in/128]; weight_zero: uint8 [..., out, in/128] |
|                 | w = (q - zero) * scale                                                      |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ninfer_runtime.quant import groupwise_int, nvfp4

Shape = tuple[int, ...]
StoredSpecs = dict[str, tuple[torch.dtype, Shape]]


class UnknownSchemeError(ValueError):
    pass


@dataclass(frozen=True)
class Scheme:
    name: str
    roles: tuple[str, ...]
    stored_specs: Callable[[Shape], StoredSpecs]
    dequantize_parts: Callable[[dict[str, torch.Tensor]], torch.Tensor]

    @property
    def quantized(self) -> bool:
        return self.roles != ("weight",)


def _plain(dtype: torch.dtype) -> Callable[[Shape], StoredSpecs]:
    return lambda shape: {"weight": (dtype, tuple(shape))}


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("bf16", ("weight",), _plain(torch.bfloat16), lambda p: p["weight"]),
        Scheme("fp32", ("weight",), _plain(torch.float32), lambda p: p["weight"]),
        Scheme("int64", ("weight",), _plain(torch.int64), lambda p: p["weight"]),
        Scheme("nvfp4", nvfp4.ROLES, nvfp4.stored_specs, nvfp4.dequantize),
        Scheme("groupwise-int", groupwise_int.ROLES, groupwise_int.stored_specs,
               groupwise_int.dequantize),
    )
}
WEIGHTS_IDS = ("bf16", "groupwise-int", "nvfp4")


def get_scheme(name: str) -> Scheme:
    try:
        return SCHEMES[name]
    except KeyError:
        raise UnknownSchemeError(
            f"unknown weight scheme {name!r} (known: {', '.join(SCHEMES)})"
        ) from None


def stored_name(logical: str, role: str) -> str:
    """`layers.0.mlp.down_proj.weight` + `weight_scale` -> `layers.0.mlp.down_proj.weight_scale`.

    Stacked expert tensors are parameters named without `.weight` (`mlp.experts.down_proj`);
    their roles get a suffix instead: `mlp.experts.down_proj_weight_scale`.
    """
    if role == "weight":
        return logical
    if logical.endswith("weight"):
        return logical[: -len("weight")] + role
    return f"{logical}_{role}"


@dataclass(frozen=True)
class PackedWeight:
    """A quantized logical weight as the runtime holds it: the scheme and its stored parts."""

    scheme: Scheme
    parts: dict[str, torch.Tensor]
    shape: Shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.scheme.dequantize_parts(self.parts).to(dtype)

    def to(self, device: torch.device | str) -> PackedWeight:
        return PackedWeight(self.scheme, {k: v.to(device) for k, v in self.parts.items()},
                            self.shape)
