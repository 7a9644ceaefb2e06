"""Evaluation: perplexity and KL divergence against a saved base."""
