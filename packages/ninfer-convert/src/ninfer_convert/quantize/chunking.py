"""Row chunking shared by the quantizers: bounds the fp32 temporaries of one pass over a weight.

A 248320 x 5120 lm_head is 1.3 G elements; quantizing it whole would need several fp32 copies
of it (5 GB each). Working on row slices of about CHUNK_ELEMS elements keeps the temporaries to
a few hundred MB on CPU or GPU while the results are written into preallocated outputs.
"""

from __future__ import annotations

from collections.abc import Iterator

CHUNK_ELEMS = 1 << 24


def row_slices(num_rows: int, row_len: int, chunk_elems: int = CHUNK_ELEMS) -> Iterator[slice]:
    """Consecutive row ranges of at most max(1, chunk_elems // row_len) rows covering num_rows."""
    step = max(1, chunk_elems // row_len)
    for start in range(0, num_rows, step):
        yield slice(start, min(start + step, num_rows))
