"""pagoda: an LLM inference serving engine."""
