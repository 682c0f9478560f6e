"""Backends: the small set of ops that model code calls, in interchangeable implementations.

`reference` is plain PyTorch (the CPU path and the ground truth tests compare against). Other
backends (Triton per-op kernels, the decode megakernel) implement the same functions with the
same semantics, so one model definition runs on all of them.
"""
