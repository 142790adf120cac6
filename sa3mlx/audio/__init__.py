"""Layer 1: audio files in, clean 44.1 kHz stereo audio + tags out (the `normalize` stage).

decode (probe, classify bad input) -> channels / resample -> dedup -> write; tags from
sidecars or embedded metadata; census report. Imports only `sa3mlx.runtime`.
"""
