"""Test fixtures: real tiny models and a real Hugging Face mirror, built at test time."""
