"""Layer 5: recompute the golden fixtures of the official SA3 implementation and compare.

Each kind's runner lives in `sa3mlx/parity/<kind>.py` and registers itself with
`registry.register`; the model issues add them one by one.
"""
