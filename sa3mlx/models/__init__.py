"""Layer 1: configs (one dataclass per concept), the networks, weight loading."""
