"""`ninfer-convert inspect FILE`: what a `.ninfer` file holds, as plain text.

Opening skips the checksum pass by default so inspecting a 15 GB file is instant; the
structural checks (versions, schemes, shapes, truncation) still run.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch

from ninfer_runtime.artifact import Artifact
from ninfer_runtime.config import FULL_ATTENTION, ConfigError, ModelConfig
from ninfer_runtime.models.dflash import DFlashConfig, DFlashConfigError
from ninfer_runtime.quant import PackedWeight


def describe(path: str | Path, *, verify: bool = False) -> str:
    """A report of the file: manifest facts, a model summary and one row per weight."""
    a = Artifact.open(path, verify=verify)
    m = a.manifest
    sizes = {name: _nbytes(a.weight(name)) for name in a.weight_names()}
    facts = [
        ("format", f"{m['format']} v{m['format_version']} (ninfer-runtime "
                   f"{m.get('ninfer_version', '?')}, created {m.get('created', '?')})"),
        ("profile", str(m.get("profile"))),
        ("weights", a.weights_id),
        ("source", _source(m)),
        *_model_facts(m["config"]),
        ("dflash", _dflash(m.get("dflash"))),
        ("draft head", _draft_head(m.get("draft_head"))),
        ("tokenizer", _present(a.tokenizer_json)),
        ("chat template", _present(a.chat_template)),
        ("generation", _pairs(a.generation_config)),
        ("options", _pairs(m.get("options") or {})),
        ("checksums", f"{m['checksum_algorithm']}, "
                      f"{'verified' if verify else 'not verified (pass verify=True)'}"),
        ("file size", _size(a.nbytes)),
        ("weights by scheme", _by_scheme(m["weights"], sizes)),
    ]
    width = max(len(k) for k, _ in facts)
    lines = [str(a.path), *(f"  {k:<{width}}  {v}" for k, v in facts), ""]
    rows = [(name, info["scheme"], "x".join(map(str, info["shape"])), f"{sizes[name]:,}",
             "-" if info["error"] is None else f"{info['error']:.3e}")
            for name, info in m["weights"].items()]
    lines += _table(("weight", "scheme", "shape", "bytes", "rel. error"), rows, right=(3, 4))
    return "\n".join(lines)


def _nbytes(w: torch.Tensor | PackedWeight) -> int:
    parts = w.parts.values() if isinstance(w, PackedWeight) else (w,)
    return sum(t.nbytes for t in parts)


def _source(m: dict[str, Any]) -> str:
    s = m["source"]
    kind = s.get("kind")
    if kind == "hub":
        text = f"hub {s.get('repo_id')} @ {s.get('revision') or 'unpinned revision'}"
    elif kind == "local":
        text = f"local {s.get('path')}"
    else:
        text = f"{kind} (seed {s.get('seed')})"
    return text + (" -- random weights" if m.get("random_init") else "")


def _model_facts(hf: dict[str, Any]) -> list[tuple[str, str]]:
    try:
        c = ModelConfig.from_hf(hf)
    except ConfigError as e:
        return [("model", f"config NInfer cannot run: {e}")]
    full = c.layer_types.count(FULL_ATTENTION)
    facts = [
        ("model", f"{c.model_type}, {c.num_layers} layers ({c.num_layers - full} GDN + {full} "
                  f"full attention), hidden {c.hidden_size}, vocab {c.vocab_size}"),
        ("attention", f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads x "
                      f"{c.head_dim} (rotary {c.rotary_dim})"),
        ("gdn", f"{c.linear_num_key_heads} k / {c.linear_num_value_heads} v heads x "
                f"{c.linear_key_head_dim}/{c.linear_value_head_dim}, "
                f"conv {c.linear_conv_kernel_dim}"),
        ("mlp", f"{c.num_experts} experts (top {c.num_experts_per_tok}) x "
                f"{c.moe_intermediate_size}, shared expert {c.shared_expert_intermediate_size}"
         if c.is_moe else f"dense, intermediate {c.intermediate_size}"),
        ("mtp", f"{c.mtp_num_hidden_layers} layer(s)"),
    ]
    vision = c.vision_config
    facts.append(("vision", f"depth {vision.get('depth')}, hidden {vision.get('hidden_size')}"
                  if vision else "none"))
    return facts


def _dflash(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "none"
    try:
        c = DFlashConfig.from_dict(entry["config"])
    except (DFlashConfigError, KeyError, TypeError) as e:
        return f"draft config NInfer cannot run: {e}"
    kinds = Counter("sliding" if w else "full" for w in map(c.window, range(c.num_layers)))
    layers = " + ".join(f"{n} {k}" for k, n in kinds.items())
    window = f", window {c.sliding_window}" if c.sliding_window else ""
    scaling = f" ({c.rope_scaling['rope_type']})" if c.rope_scaling else ""
    return (f"{c.num_layers} layers ({layers}{window}), hidden {c.hidden_size}, "
            f"{c.num_attention_heads} q / {c.num_key_value_heads} kv heads x {c.head_dim}, "
            f"intermediate {c.intermediate_size}, block {c.block_size}, mask "
            f"{c.mask_token_id}, taps {list(c.target_layer_ids)}, rope theta "
            f"{c.rope_theta:g}{scaling}; from {_source(entry)}")


def _draft_head(record: dict[str, Any] | None) -> str:
    if record is None:
        return "none"
    text = f"{record.get('size')} tokens by {record.get('method')}"
    calibration = record.get("calibration")
    if calibration:
        text += f" ({calibration.get('file')}, {calibration.get('tokens')} tokens)"
    return text + f", {record.get('always_included')} added tokens and eos ids always in"


def _present(text: str | None) -> str:
    return "absent" if text is None else f"present ({len(text):,} chars)"


def _pairs(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "-"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n:,} bytes ({n / scale:.1f} {unit})"
    return f"{n:,} bytes"


def _by_scheme(weights: dict[str, Any], sizes: dict[str, int]) -> str:
    counts = Counter(info["scheme"] for info in weights.values())
    nbytes: Counter[str] = Counter()
    for name, info in weights.items():
        nbytes[info["scheme"]] += sizes[name]
    return "; ".join(f"{s}: {counts[s]} weights, {_size(nbytes[s])}" for s in counts) or "-"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[int, ...]
           ) -> list[str]:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        cells = (c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths, strict=True)))
        return "  ".join(cells).rstrip()

    return [line(header), line(tuple("-" * w for w in widths)), *map(line, rows)]
