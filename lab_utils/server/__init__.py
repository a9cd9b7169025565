"""An OpenAI-compatible HTTP server over LLMEngine (FastAPI + a background engine loop)."""
