"""What runs inside a training step: tiny, and free of heavy imports."""
