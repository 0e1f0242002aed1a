"""turboquant.kernels"""
