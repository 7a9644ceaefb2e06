"""Speculative drafters: the speculator interface and priority chain (``base``) and the
n-gram drafters with llama.cpp's semantics (``ngram``)."""
