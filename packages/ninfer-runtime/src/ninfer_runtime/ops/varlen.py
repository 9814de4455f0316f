"""Fixed-shape grids over variable-length segments (one launch whatever the lengths).

A flat batch of N rows in B segments (cu_seqlens) is cut into blocks of `block` rows per
segment. Segment b's blocks start at program (cu[b] - b) // block + b: that leaves room for
every segment's ceil(len / block) blocks whatever the lengths, in at most
(N - B) // block + B programs (exactly B for B single-row segments), so the grid depends on
shapes alone and needs no device read-back. A program past its segment's last block is spare
and returns.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only install: nothing here is used
    triton = None


def num_blocks(num_rows: int, num_segments: int, block: int) -> int:
    """Programs a grid needs for any split of num_rows rows into num_segments segments."""
    return (num_rows - num_segments) // block + num_segments


if triton is not None:

    @triton.jit
    def block_of(cu_ptr, p, num_segments, BLOCK: tl.constexpr):
        """(segment, first row) of program p: the last segment b whose first program
        (cu[b] - b) // BLOCK + b is <= p, by binary search. The first row is at or past the
        segment's end for a spare program."""
        lo: tl.int32 = 0
        hi = num_segments - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if (tl.load(cu_ptr + mid) - mid) // BLOCK + mid <= p:
                lo = mid
            else:
                hi = mid - 1
        start = tl.load(cu_ptr + lo)
        return lo, start + (p - (start - lo) // BLOCK - lo) * BLOCK
