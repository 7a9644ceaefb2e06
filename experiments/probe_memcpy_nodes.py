"""Can a captured host -> device memcpy node be re-pointed in place? The question behind
``kvstream.engine.graph_copies``: one copy of 1 row and one of 2 rows (a grouped ring copy's
shape) captured in a graph, then given another source, width and pitch through the
instantiated graph (``cudaGraphExecMemcpyNodeSetParams``) and through the graph plus
``cudaGraphExecUpdate``; each replay checked against the rows it should have copied, each call
timed.

    python experiments/probe_memcpy_nodes.py      # CUDA; results/capture/probe_memcpy_nodes.txt
"""
import time

import torch

from kvstream.cache.cudart import copy_rows, memcpy_nodes, retarget, rows_of, set_exec_memcpy, set_graph_memcpy, update_exec

torch.manual_seed(0)
host = torch.randint(0, 255, (4, 1 << 20), dtype=torch.uint8).pin_memory()  # 4 "layers" x 1 MiB
dev = torch.zeros(4 * (1 << 20), dtype=torch.uint8, device="cuda")
side = torch.cuda.Stream()
copy = torch.cuda.Stream()
print("raw exec accessor:", hasattr(torch.cuda.CUDAGraph, "raw_cuda_graph_exec"), torch.__version__, torch.version.cuda)

def views(rows, width, src_off, dpitch):
    d = dev[: (rows - 1) * dpitch + width].as_strided((rows, width), (dpitch, 1))
    s = host[:rows, src_off:src_off + width]
    return d, s

def make(rows, width, src_off, dpitch):
    g = torch.cuda.CUDAGraph(keep_graph=True)
    d, s = views(rows, width, src_off, dpitch)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=side):
        copy.wait_stream(torch.cuda.current_stream())
        copy_rows(d, s, copy)
        torch.cuda.current_stream().wait_stream(copy)
        out = dev.view(torch.int32)[:16].clone()
    g.instantiate()
    return g, out

def check(rows, width, src_off, dpitch, label):
    dev.zero_(); torch.cuda.synchronize()
    g.replay(); torch.cuda.synchronize()
    d, s = views(rows, width, src_off, dpitch)
    ok = torch.equal(d.cpu(), s)
    print(f"  {label}: replay copies the new rows: {ok}")
    return ok

for rows in (1, 2):
    print(f"rows={rows}")
    g, out = make(rows, 65536, 0, 131072)
    nodes = memcpy_nodes(g.raw_cuda_graph())
    print("  memcpy nodes:", len(nodes), [p.rows() for _, p in nodes], "kind", [p.kind for _, p in nodes])
    d, s = views(rows, 65536, 0, 131072)
    print("  matches rows_of:", nodes[0][1].rows() == rows_of(d, s))
    node, params = nodes[0]
    new = views(rows, 98304, 4096, 196608)
    retarget(params, rows_of(*new))
    t0 = time.perf_counter()
    err = set_exec_memcpy(g.raw_cuda_graph_exec(), node, params)
    t1 = time.perf_counter()
    print(f"  exec set: err {err} in {1e6 * (t1 - t0):.1f} us")
    if not err:
        check(rows, 98304, 4096, 196608, "exec set")
        n = 200
        t0 = time.perf_counter()
        for i in range(n):
            retarget(params, rows_of(*views(rows, 65536 + 4096 * (i % 3), 4096 * (i % 5), 196608)))
            set_exec_memcpy(g.raw_cuda_graph_exec(), node, params)
        print(f"  exec set incl. retarget: {1e6 * (time.perf_counter() - t0) / n:.1f} us per node")
        retarget(params, rows_of(*new)); set_exec_memcpy(g.raw_cuda_graph_exec(), node, params)
    try:
        new2 = views(rows, 32768, 8192, 65536)
        retarget(params, rows_of(*new2))
        t0 = time.perf_counter()
        set_graph_memcpy(node, params)
        update_exec(g.raw_cuda_graph_exec(), g.raw_cuda_graph())
        print(f"  graph set + exec update: ok in {1e6 * (time.perf_counter() - t0):.1f} us")
        check(rows, 32768, 8192, 65536, "graph set + exec update")
    except RuntimeError as e:
        print("  graph set + exec update:", e)
