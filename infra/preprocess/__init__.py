"""preprocess."""
