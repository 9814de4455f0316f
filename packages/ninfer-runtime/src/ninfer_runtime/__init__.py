"""NInfer runtime: the .ninfer format, model configs, ops, models and the offline LLM API.

`LLM` and `GenerationResult` are imported lazily, so `import ninfer_runtime` (or any of its
light submodules such as config and profiles) does not pull in the model stack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ninfer_runtime.llm import LLM, GenerationResult

__all__ = ["LLM", "GenerationResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from ninfer_runtime import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'ninfer_runtime' has no attribute {name!r}")
