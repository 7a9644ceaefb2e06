"""kvstream: long-context LLM decoding on a bounded GPU memory budget."""

import os

# Back large CPU tensors with transparent huge pages (torch reads this once, at its first large
# allocation). Decode streams every weight once per token; with 4 KiB pages the first passes over
# freshly allocated weights ran at half speed here (4.2 vs 8.6 tok/s on the 0.5B) until the kernel
# collapsed the pages in the background. Set it to 0 to opt out.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
