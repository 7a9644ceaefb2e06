"""The model: GGUF loading and registry, tokenizer, the Qwen forward, sampling."""
