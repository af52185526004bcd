"""Generation and rollouts."""
