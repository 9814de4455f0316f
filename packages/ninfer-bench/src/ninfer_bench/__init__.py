"""NInfer benchmarks."""
