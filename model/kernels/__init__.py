"""Fused GPU kernels for MLX, used where MLX's own ops fall short; the unfused MLX path stays
the reference (CPU, Metal, and every test) and the fallback."""
