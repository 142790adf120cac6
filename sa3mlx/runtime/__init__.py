"""Layer 0: device and precision policy, BLAS set-up, atomic writes, hashing, params."""
