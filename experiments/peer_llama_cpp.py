"""llama.cpp's greedy decode for bench_peers, in a process of its own: llama.cpp's CUDA build and
torch's CUDA libraries in one process crash (a segfault on the H200), so this module
imports neither torch nor kvstream.

    python -m experiments.peer_llama_cpp MODEL.gguf PROMPT.json NEW_TOKENS cuda|cpu
prints one JSON line: decode tok/s, prefill tok/s, the generated tokens.
"""

from __future__ import annotations

import json
import sys
import time


def decode(path: str, prompt: list[int], new: int, device: str) -> dict:
    import llama_cpp  # before numpy: numpy imported first makes llama.cpp's model load segfault (H200)
    import numpy as np

    llm = llama_cpp.Llama(path, n_ctx=len(prompt) + new + 16, n_gpu_layers=-1 if device.startswith("cuda") else 0,
                          flash_attn=True, type_k=llama_cpp.GGML_TYPE_Q8_0, type_v=llama_cpp.GGML_TYPE_Q4_0,
                          n_batch=512, logits_all=False, verbose=False)
    vocab = llm.n_vocab()
    last = lambda: int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())
    llm.eval(prompt[:256])  # warm-up (CUDA graphs, kernels), then a fresh context
    llm.reset()  # eval drops the cache past n_tokens
    t0 = time.perf_counter()
    llm.eval(prompt)
    t1 = time.perf_counter()
    out = [last()]
    t2 = time.perf_counter()
    for _ in range(new - 1):  # greedy, one token per eval: the same loop as kvstream's decode
        llm.eval([out[-1]])
        out.append(last())
    t3 = time.perf_counter()
    return {"decode_tok_s": (new - 1) / (t3 - t2), "prefill_tok_s": len(prompt) / (t1 - t0), "tokens": out}


if __name__ == "__main__":
    path, prompt_file, new, device = sys.argv[1:5]
    print(json.dumps(decode(path, json.load(open(prompt_file)), int(new), device)))
