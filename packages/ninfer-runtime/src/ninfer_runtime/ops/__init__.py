"""Operators: plain torch references, one module per op family, plain tensors in and out.

Each public function here is the reference (and the CPU path); a Triton kernel can later sit
behind the same call without its callers changing.
"""
