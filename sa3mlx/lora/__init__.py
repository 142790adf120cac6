"""Layer 2: LoRA-family adapters in SA3's own conventions.

`types` names the nine adapter types, `maths` their effective weights, `layers` the MLX
modules that wrap a frozen Linear/Conv1d, `targeting` which layers get one, `inject` puts
them on a loaded DiT + Conditioner, `checkpoint` the official safetensors format, `validate`
underfit's upload contract, `svd` the -xs bases and `bases` their files (the svd stage),
`merge` bakes adapters (ours or `peft`'s format) into a converted DiT.
"""
