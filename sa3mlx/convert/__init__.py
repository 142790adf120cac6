"""Layer 2: torch checkpoint -> MLX arrays, as pure key-mapping functions."""
