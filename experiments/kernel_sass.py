"""What decode attention compiles to on an H200, on a machine without a GPU.

Triton compiles for a target, not for a device: this builds ``_decode_attention_kernel`` for
sm_90 with the pointer and stride divisibility a real launch specializes on (without it the
tiles compile to byte loads), disassembles the cubin with the nvdisasm bundled in Triton, and
prints the registers, the shared memory, the shared-memory layouts the TTGIR chose, and the
instruction mix of the key loop's body: the loop over whole tiles, which needs no masks (the
masked loop over a range's last tiles is counted beside it). Counts per thread per tile; the
loop is what runs per 64 or 128 keys.

    python -m experiments.kernel_sass                       # q8_0/q4_0, n_q 1 and 6
    python -m experiments.kernel_sass --pair q8_0 q8_0 --n-q 1 2 --out /tmp/sass
    python -m experiments.kernel_sass --all-pairs --csv loops.csv    # every pair, rows with the commit
    python -m experiments.kernel_sass --report a.csv b.csv           # commits side by side
    python -m experiments.kernel_sass --n-q 1 --launch 64 1 2        # another launch: 64-key tiles, 1 warp
    python -m experiments.kernel_sass --q8-gemv 16 512 4 [--int8 | --xq]   # kernels/q8_gemv.py's loop, one row
    python -m experiments.kernel_sass --q8-gemv 4 2048 4 --xq --split 2    # (K shared; --glu-q8: gate/up's h blocks)

Match the device's Triton version (3.6 on the H200 the results come from): another version
compiles other code. One way, without touching the environment: ``pip install --target /tmp/t36
--no-deps triton==3.6.0`` and run with ``PYTHONPATH=/tmp/t36``. What it shows for decode
attention is in kernels/NOTES.md: unswizzled byte tiles in shared memory.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import decode_attention as da
from kernels.formats import PageFormat

POINTERS = {"q": "*fp16", "k_pool": "*u8", "v_pool": "*u8", "page_table": "*i32", "p_len": "*i64",
            "p_start": "*i64", "p_end": "*i64", "out": "*fp16", "part_m": "*fp32", "part_l": "*fp32",
            "part_acc": "*fp32"}
SHARED_OPS = r"\b(LDS|STS|LDSM|STSM|BAR)\S*"


def _compile(kern, const: dict, types, aligned, arch: int, **options):
    """``kern`` compiled for sm_``arch`` with ``const``'s constexprs, each argument's type from ``types(name)``
    and the 16-byte divisibility a launch specializes ``aligned(name)`` arguments on (without it the tiles
    compile to narrow loads)."""
    sig, consts, attrs = {}, {}, {}
    for i, p in enumerate(kern.params):
        if p.is_constexpr:
            sig[p.name], consts[(i,)] = "constexpr", const[p.name]
            continue
        sig[p.name] = types(p.name)
        if aligned(p.name):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kern, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


N_HEADS, N_KV_HEADS, HEAD_DIM = 12, 2, 128  # Qwen2.5-Coder-1.5B's attention


def compile_decode(pair, n_q, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, arch=90):
    """The decode kernel as ``decode_attention`` launches it for these shapes (its LAUNCH row)."""
    kf, vf = PageFormat(pair[0], n_kv_heads, head_dim), PageFormat(pair[1], n_kv_heads, head_dim)
    gqa = n_heads // n_kv_heads
    block_m = da.block_rows(n_q, gqa)
    launch = da.LAUNCH[block_m]
    const = dict(N_Q=n_q, GQA=gqa, N_HEADS=n_heads, HEAD_DIM=head_dim, K_FMT=kf.kv_type.code,
                 K_PAGE_BYTES=kf.page_bytes, K_SCALE_OFF=kf.scale_offset, V_FMT=vf.kv_type.code,
                 V_PAGE_BYTES=vf.page_bytes, V_SCALE_OFF=vf.scale_offset, BLOCK_M=block_m,
                 BLOCK_N=launch.block_n, HAS_START=False, HAS_END=False, WRITE_OUT=False,
                 ROUND=False, CARRY=False, ASM=True, PDL=False)
    return _compile(da._decode_attention_kernel, const,
                    lambda name: POINTERS.get(name, "fp32" if name == "sm_scale" else "i32"),
                    lambda name: (name in POINTERS and name not in da.UNALIGNED) or name.startswith("stride"), arch,
                    num_warps=launch.num_warps, num_stages=launch.num_stages, maxnreg=launch.maxnreg)


def compile_q8_gemv(block_n: int, block_k: int, num_warps: int, int8: bool, xq: bool = False, arch=90,
                    split: int = 1, glu_q8: bool = False):
    """``kernels/q8_gemv.py``'s kernel for one bf16 row with PDL, as a launch specializes it (``xq``: int8
    with x's blocks given; ``split``: K shared by that many programs; ``glu_q8``: gate/up's SwiGLU writing
    h's q8_0 blocks)."""
    from kernels import q8_gemv

    const = dict(ROWS=1, ROWS_P=1, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=False, GLU=glu_q8, INT8=int8 or xq,
                 XQ=xq, Q8_OUT=glu_q8, SPLIT=split, ASM=True, PDL=True)
    ptr = {"x": "*bf16", "q": "*i32", "d": "*fp16", "bias": "*fp16", "out": "*bf16", "xq": "*i32", "xd": "*fp16",
           "oq": "*i8", "od": "*fp16", "counts": "*i32",
           "sums": "*fp32"}
    return _compile(q8_gemv._q8_gemv_kernel, const, lambda name: ptr.get(name, "i32"),
                    lambda name: name in ptr or name.startswith("stride") or name == "n_w", arch, num_warps=num_warps)


def q8_gemv_report(block_n: int, block_k: int, num_warps: int, int8: bool, xq: bool = False, split: int = 1,
                   glu_q8: bool = False) -> dict:
    """The K loop's instructions per thread and per weight byte (a tile is block_n x block_k quants), and the
    kernel's registers a thread."""
    sass, res = disassemble(compile_q8_gemv(block_n, block_k, num_warps, int8, xq, split=split, glu_q8=glu_q8))
    body = loop_body(sass)
    mix = collections.Counter(opcode(line) for line in body)
    per_byte = len(body) * 32 * num_warps / (block_n * block_k)
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    mode = ", int8, x's blocks given" if xq else ", int8" if int8 else ""
    mode += (f", K split {split} ways" if split > 1 else "") + (", SwiGLU + h's blocks" if glu_q8 else "")
    print(f"q8_gemv {block_n} rows, {block_k}-wide tiles, {num_warps} warps{mode}: loop body "
          f"{len(body)} instructions a thread, {per_byte:.2f} a weight byte, {regs} registers")
    print("  mix:   " + ", ".join(f"{k} {n}" for k, n in mix.most_common(16)))
    return dict(block_n=block_n, block_k=block_k, num_warps=num_warps, int8=int8, xq=xq, split=split, glu_q8=glu_q8,
                loop_instructions=len(body), per_weight_byte=per_byte, registers=regs)


def _tool(name: str) -> str:
    return os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin", name)


def disassemble(compiled) -> tuple[str, str]:
    """(SASS, resource usage) of a compiled kernel's cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([_tool("nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return sass, res


def loops(sass: str, least: int = 100) -> list[list[str]]:
    """The instructions of every loop of at least ``least`` instructions (from a label to the branch
    back to it), in program order."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    found = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x for x in lines[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
            if len(body) >= least:
                found.append((labels[m.group(1)], body))
    return [body for _, body in sorted(found, key=lambda f: f[0])]


def loop_body(sass: str) -> list[str]:
    """The instructions of the largest loop."""
    return max(loops(sass, 0), key=len, default=[])


def opcode(line: str, full: bool = False) -> str:
    op = re.sub(r"^.*\*/\s*(@!?U?P\w+\s+)?", "", line).strip().split(" ")[0].rstrip(";")
    return op if full else op.split(".")[0]


def report(pair, n_q, out=None) -> dict:
    c = compile_decode(pair, n_q)
    sass, res = disassemble(c)
    # the key loops in program order: the whole tiles without masks, then the masked last tiles (compile_decode
    # builds without a key start, so no masked first-tile loop comes before them)
    found = loops(sass)
    if not found:
        raise RuntimeError(f"no loop of >= 100 instructions in the {pair} n_q={n_q} build: has the kernel changed?")
    body, *edges = found
    mix = collections.Counter(opcode(line) for line in body)
    shared = collections.Counter(opcode(line, full=True) for line in body if re.search(SHARED_OPS, line))
    layouts = sorted(set(re.findall(r"#ttg\.swizzled_shared<\{[^}]*\}>", c.asm["ttgir"])))
    regs = re.search(r"REG:(\d+)", res)
    launch = da.LAUNCH[da.block_rows(n_q, N_HEADS // N_KV_HEADS)]
    row = dict(pair="/".join(pair), n_q=n_q, block_n=launch.block_n, num_warps=launch.num_warps,
               registers=int(regs.group(1)) if regs else None,
               shared_bytes=c.metadata.shared, loop_instructions=len(body),
               edge_loop_instructions=len(edges[0]) if edges else None)
    print(f"{row['pair']} n_q={n_q}: {row['registers']} registers, {row['shared_bytes']} B shared, "
          f"loop body {len(body)} instructions (whole tiles; the masked last tiles' loop "
          f"{row['edge_loop_instructions']})")
    print("  mix:   " + ", ".join(f"{k} {n}" for k, n in mix.most_common(16)))
    print("  shared:" + ", ".join(f" {k} {n}" for k, n in sorted(shared.items())))
    print("  layouts: " + "; ".join(layouts))
    if out:
        os.makedirs(out, exist_ok=True)
        stem = os.path.join(out, f"decode_{pair[0]}_{pair[1]}_nq{n_q}")
        for ext, text in (("sass", sass), ("ttgir", c.asm["ttgir"]), ("ptx", c.asm["ptx"])):
            with open(f"{stem}.{ext}", "w") as f:
                f.write(text)
    return row


PAIRS = [("q8_0", "q4_0"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "f16")]


def compare(paths: list[str]) -> "pd.DataFrame":
    """The loop's instructions per thread per tile and warp-instructions per key of each (pair, n_q), one
    column pair per commit (``+``: its tree had uncommitted changes), from ``--csv`` files."""
    import pandas as pd

    df = pd.concat([pd.read_csv(f) for f in paths], ignore_index=True)
    df["per_key"] = df.loop_instructions * df.num_warps / df.block_n
    df["commit"] = df.commit.str[:7] + df.dirty.map({True: "+", False: ""})  # +: uncommitted changes
    table = df.pivot_table(index=["pair", "n_q"], columns="commit", values=["loop_instructions", "per_key"],
                           sort=False)
    return table.round(1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", nargs=2, default=["q8_0", "q4_0"], metavar=("K", "V"), help="K and V page types")
    p.add_argument("--all-pairs", action="store_true", help=f"every pair of {PAIRS} instead of --pair")
    p.add_argument("--n-q", type=int, nargs="+", default=[1, 6], help="query rows (1 + draft tokens)")
    p.add_argument("--out", help="also write each kernel's SASS, TTGIR and PTX here")
    p.add_argument("--csv", help="also write the rows (with the commit and versions) to this CSV")
    p.add_argument("--launch", type=int, nargs=3, metavar=("BLOCK_N", "WARPS", "STAGES"),
                   help="compile with this launch instead of decode_attention's LAUNCH row (a sweep variant)")
    p.add_argument("--report", nargs="+", metavar="CSV", help="instead: compare --csv files (commits side by side)")
    p.add_argument("--q8-gemv", type=int, nargs=3, metavar=("ROWS", "BLOCK_K", "WARPS"),
                   help="instead: kernels/q8_gemv.py's loop at this launch")
    p.add_argument("--int8", action="store_true", help="--q8-gemv: the int8 dot (model.weights=q8_0_int8)")
    p.add_argument("--xq", action="store_true", help="--q8-gemv: the int8 dot with x's q8_0 blocks given")
    p.add_argument("--split", type=int, default=1, help="--q8-gemv: K shared by this many programs (Launch.split)")
    p.add_argument("--glu-q8", action="store_true", help="--q8-gemv: gate/up's SwiGLU writing h's q8_0 blocks")
    args = p.parse_args(argv)
    if args.report:
        table = compare(args.report)
        print(table.to_string())
        return table
    print(f"triton {triton.__version__}, sm_90")
    if args.q8_gemv:
        return [q8_gemv_report(*args.q8_gemv, args.int8, args.xq, args.split, args.glu_q8)]
    if args.launch:
        for n_q in args.n_q:
            da.LAUNCH[da.block_rows(n_q, N_HEADS // N_KV_HEADS)] = da.Launch(*args.launch, programs_per_sm=4)
    pairs = PAIRS if args.all_pairs else [tuple(args.pair)]
    rows = [report(pair, n_q, args.out) for pair in pairs for n_q in args.n_q]
    if args.csv:
        import pandas as pd

        from experiments.common import kernel_provenance

        prov = {k: v for k, v in kernel_provenance().items() if k not in ("gpu", "torch")}  # compiled, not run
        pd.DataFrame([{**r, **prov} for r in rows]).to_csv(args.csv, index=False)
    return rows


if __name__ == "__main__":
    main()
