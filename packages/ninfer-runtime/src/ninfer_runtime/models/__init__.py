"""The Qwen3.5-family text model, its MTP head and their caches."""

from ninfer_runtime.models.cache import GDNSlots, LayerCache, PagedKV, SequenceCache
from ninfer_runtime.models.mtp import Qwen3_5MTP
from ninfer_runtime.models.qwen3_5 import Qwen3_5Model
from ninfer_runtime.models.weights import WeightError

__all__ = ["GDNSlots", "LayerCache", "PagedKV", "Qwen3_5MTP", "Qwen3_5Model", "SequenceCache",
           "WeightError"]
