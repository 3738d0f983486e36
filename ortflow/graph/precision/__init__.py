"""Mixed precision as graph rewrites: the autocast pass, no-op casts, the GPU engine's half-precision kernels."""
