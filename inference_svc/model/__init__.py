"""The Llama-family decoder, its parallel layers, and the executor the engine drives."""
