"""Knowledge distillation of a small draft model from SmolLM2 (lab 06; the draft of lab 07's speculative decoding)."""
