"""Layer 4: LoRA training in underfit's conventions.

`presets` holds the one table of defaults (`resolve` -> TrainConfig); `timesteps` the samplers;
`objective` noising, conditioning dropout, inpainting masks and the masked loss; `step` the
compiled loss/grad/update core; `session` a model with adapters, optimizer and prompt cache
(`TrainingSession`); `optim` AdamW, lr schedules, clipping and accumulation; `loop` the training
loop; `runs` run directories, checkpoint cadence and signals; `resume` resume state and the
fingerprint rule; `guards` the non-finite guard and stall watchdog; `metrics` dvclive; `job` one
stage run; `progress` the console / tqdm / loss_by_timestep.bin output the dashboard parses.
"""
