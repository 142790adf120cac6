"""Layer 3: sampling schedules, samplers (Euler / ping-pong) and classifier-free guidance."""
