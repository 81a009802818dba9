"""Offline dataset generation for diffusion transformers: manifest in, images and metadata out."""
