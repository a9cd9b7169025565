"""Models: a readable Llama-family transformer, its loader and a registry of named models."""
