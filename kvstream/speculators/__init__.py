"""Speculative drafters: the speculator interface and its counters (``base``), the priority
chain and ``build_chain`` (``chain``), the config names (``registry``), the n-gram drafters
with llama.cpp's semantics (``ngram``) and the draft model (``draft``)."""
