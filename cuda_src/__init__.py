"""CUDA kernel sources of cupy_merge, installed as package data and compiled at run time by NVRTC."""
