"""Speculative drafters: the speculator interface and its counters (``base``), the priority
chain and ``build_chain`` (``chain``), the config names (``registry``), the n-gram drafters
with llama.cpp's semantics (``ngram_simple``, ``ngram_map_k``, ``ngram_mod``, sharing
``ngram_common``) and the draft model (``draft``)."""
