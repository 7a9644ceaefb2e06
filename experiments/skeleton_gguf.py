"""Write a skeleton of a GGUF: every metadata key (architecture, shapes, tokenizer, chat
template) and one placeholder tensor, no weights. Loading it gives seeded random weights of the
model's real shapes (``kvstream.model.loader.random_weights``): timing studies on the GPU machine at
real shapes and with the real tokenizer, without carrying gigabytes of weights there.

    python experiments/skeleton_gguf.py qwen2.5-coder-1.5b .models/qwen2.5-coder-1.5b.skeleton.gguf
"""

from __future__ import annotations

import argparse

import numpy as np
from gguf import GGUFValueType, GGUFWriter

from kvstream.model.loader import SKELETON, open_gguf
from kvstream.model.registry import resolve_model


def write_skeleton(src, dst) -> None:
    reader = open_gguf(src)
    arch = reader.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    w.add_bool(SKELETON, True)
    names = {t.name for t in reader.tensors}
    for name in ("token_embd.weight", "output.weight"):  # read_config looks for these (tied output or not)
        if name in names:
            w.add_tensor(name, np.zeros(1, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a registered model name or a GGUF path")
    ap.add_argument("out")
    args = ap.parse_args()
    write_skeleton(resolve_model(args.model), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
