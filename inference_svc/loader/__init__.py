"""Loading weights: safetensors on mmap, the tensor-parallel plan, pre-sharded checkpoints, tokenizer."""
