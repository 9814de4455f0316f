"""Hugging Face transformers on the same shapes: bf16 random weights of a registered profile,
a prompt of CTX tokens, greedy decode of TOKENS tokens with `generate` (its own KV / GDN cache).

The comparison point for `ninfer-bench engine` in docs/perf.md: prefill tok/s (time to the first
token) and decode tok/s (the rest), one request. Usage on the GPU machine:

    python3 scripts/hf_baseline.py qwen3_6_27b --context 8192 --tokens 64

(`--device cpu` with a tiny profile checks the script itself without a GPU.)
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("profile")
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)

    import transformers

    from ninfer_runtime.profiles import get_profile

    hf = get_profile(args.profile).hf_config
    text = dict(hf.get("text_config", hf))
    moe = bool(text.get("num_experts"))
    prefix = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{prefix}TextConfig")(**text)
    torch.manual_seed(0)
    # built in bf16 directly: a 27B made in fp32 first (108 GB) and then cast would not fit
    torch.set_default_dtype(torch.bfloat16)
    with device:
        model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    prompt = torch.randint(0, min(100_000, config.vocab_size), (1, args.context), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def generate(n: int) -> float:
        sync()
        start = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        sync()
        return time.perf_counter() - start

    generate(2)  # warm-up
    first = generate(1)
    total = generate(args.tokens)
    print(json.dumps({
        "profile": args.profile, "transformers": transformers.__version__,
        "context": args.context, "tokens": args.tokens,
        "prefill_tok_s": args.context / first,
        "decode_tok_s": (args.tokens - 1) / (total - first),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}))


if __name__ == "__main__":
    main()
