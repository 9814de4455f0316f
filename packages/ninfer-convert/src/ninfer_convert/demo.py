"""The embedded default model and `make demo`.

The default model is the built-in `tiny_dense` profile with random weights (seed 0), converted
to NVFP4 once and cached, so the demo and a bare `ninfer-serve` run the real path
(convert -> .ninfer -> runtime) on any machine without a download. Its text is noise.
"""

from __future__ import annotations

import os
from pathlib import Path

from ninfer_convert.build import BuildOptions, build
from ninfer_convert.sources import open_source

DEFAULT_PROFILE = "tiny_dense"
DEFAULT_WEIGHTS = "nvfp4"


def cache_dir() -> Path:
    return Path(os.environ.get("NINFER_HOME", Path.home() / ".cache" / "ninfer"))


def default_artifact(directory: Path | None = None) -> Path:
    """Path of the default artifact, built on first use (atomically, so concurrent first uses
    never see a partial file)."""
    path = (directory or cache_dir()) / f"{DEFAULT_PROFILE}_{DEFAULT_WEIGHTS}_random.ninfer"
    if not path.exists():
        source = open_source(DEFAULT_PROFILE, random_init=True, seed=0)
        build(source, path, BuildOptions(weights=DEFAULT_WEIGHTS))
    return path


def main() -> None:
    from ninfer_runtime import LLM

    path = default_artifact(Path("out"))
    llm = LLM(path, device="cpu")
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    prompt = llm.tokenizer.apply_chat_template(messages, enable_thinking=False)
    result = llm.generate(prompt, max_tokens=32, temperature=0.8, top_p=0.95, seed=0)
    print(f"artifact: {path} ({DEFAULT_PROFILE}, {DEFAULT_WEIGHTS}, RANDOM weights: "
          "the text below is noise, the path that made it is real)")
    print(f"prompt:   {prompt!r}")
    print(f"output:   {result.text!r}  [{len(result.token_ids)} tokens, {result.finish_reason}]")


if __name__ == "__main__":
    main()
