"""The CPU kernels: C sources (`csrc/`) built and cached at first use, their ctypes bindings, the
matmul kernels and the per-machine probe that chooses among them, each with a stock-PyTorch
fallback; handed weights and shapes, it knows no architecture.
"""
