"""Layer 4: LoRA training in underfit's conventions.

`presets` holds the one table of defaults (`resolve` -> TrainConfig); `timesteps` the samplers
and training shifts; `optim` AdamW, lr schedules, clipping and accumulation; `progress` the
console / tqdm / loss_by_timestep.bin output the underfit dashboard parses.
"""
