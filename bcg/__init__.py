"""Bucketed CUDA graphs: bucket arithmetic, static buffers, capture and replay. No prompts, no files."""
