"""Model architectures and their layers: the Llama family and BERT, tensor-parallel and pipeline
splits, paged attention, and the architecture -> class registry; which kernel runs a matmul is asked
of forerun.kernels, never chosen here.
"""
