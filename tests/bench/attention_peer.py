#!/usr/bin/env python3
"""Peer decode-attention timings for tests/gpu/attention_bench, and the merge of both.

  attention_peer.py run --out peer.json [--q_heads 32 --kv_heads 8 --head_dim 128]
                        [--shapes 1x32768,8x8192,...]
      On the GPU machine, with PyTorch: for the benchmark's shapes (by default the six of the
      issue, 32 q heads, 8 KV heads, head_dim 128; the flags take attention_bench's geometry
      flags' values), times
        * sdpa_flash_fp16: torch SDPA restricted to the FLASH_ATTENTION backend on contiguous fp16
          K/V [batch, kv_heads, context, head_dim], q [batch, q_heads, 1, head_dim], GQA through
          enable_gqa=True (no expanded copy of K/V). This is the anchor.
        * flashinfer_fp16 / flashinfer_fp8: FlashInfer's paged decode, when `import flashinfer`
          works; otherwise the reason is recorded.
      Timing as in the C++ benchmark: CUDA events around one call, L2 flushed before every run
      (--l2_flush: a 256 MiB buffer read, or zeroed, as attention_bench's flag), median of
      --iters runs after warm-up. Bytes: K/V read + q + out.

  attention_peer.py merge --kvpool kvpool.json --peer peer.json [--flashinfer fi.json]
                         --out attention_<date>.json
      Joins the files per (batch, context) and adds each kvpool format's speed-up over the anchor
      and its fraction of the streaming-read bandwidth, with the targets (INT4 >= 3.3x and >= 80%
      of streaming bandwidth, FP8 >= 1.8x, FP16 paged >= 1.0x; set for the issue's geometry
      only) marked met or missed, and its speed-up over each of FlashInfer's paged decode paths
      measured. --flashinfer takes the timings of tests/bench/flashinfer_decode_bench.cu
      (FlashInfer's C++ kernels built into a binary, for a GPU machine without its Python
      package, at the issue's geometry) where `run` had none. Files of different geometries are
      refused.
"""
import argparse
import datetime
import json
import statistics
import sys

# The C++ benchmarks' bench::kDecodeShapes (tests/common/bench_output.h; attention_peer_test.py
# checks that the two agree).
SHAPES = "1x32768,8x8192,8x32768,32x4096,32x16384,64x8192"
# The issue's geometry (q heads, KV heads, head_dim): files without geometry fields were timed at
# it, and the targets are set for it.
ISSUE_GEOMETRY = (32, 8, 128)
BLOCK_TOKENS = 16
TARGETS = {"int4_rot128": 3.3, "fp8_rot128": 1.8, "fp16": 1.0}
INT4_STREAM_TARGET = 0.80
# FlashInfer's paged decode: CUDA-core kernel (the wrapper's default) and tensor-core path
# (use_tensor_cores=True), fp16 and fp8 pages.
FLASHINFER_VARIANTS = ("flashinfer_fp16", "flashinfer_fp8", "flashinfer_tc_fp16",
                       "flashinfer_tc_fp8")


def time_ms(torch, fn, iters, flush):
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        flush()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def geometry(d):
    """(q heads, KV heads, head_dim) of a results file."""
    return tuple(d.get(k, v) for k, v in zip(("q_heads", "kv_heads", "head_dim"), ISSUE_GEOMETRY))


def parse_shapes(text):
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]


def run_sdpa(torch, geo, batch, context, iters, flush):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    q_heads, kv_heads, head_dim = geo
    q = torch.randn(batch, q_heads, 1, head_dim, device="cuda", dtype=torch.float16)
    k = torch.randn(batch, kv_heads, context, head_dim, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)

    def call():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    ms = time_ms(torch, call, iters, flush)
    nbytes = 2 * k.numel() * 2 + q.numel() * 2 * 2
    return {"ms": ms, "bytes": nbytes, "tbps": nbytes / (ms * 1e-3) / 1e12}


def run_flashinfer(torch, flashinfer, geo, batch, context, kv_dtype, iters, flush):
    q_heads, kv_heads, head_dim = geo
    pages_per_seq = context // BLOCK_TOKENS
    num_pages = batch * pages_per_seq
    cache = torch.randn(num_pages, 2, BLOCK_TOKENS, kv_heads, head_dim, device="cuda",
                        dtype=torch.float16).to(kv_dtype)
    indices = torch.randperm(num_pages, device="cuda", dtype=torch.int32)  # scattered pages
    indptr = torch.arange(0, num_pages + 1, pages_per_seq, device="cuda", dtype=torch.int32)
    last_len = torch.full((batch,), BLOCK_TOKENS, device="cuda", dtype=torch.int32)
    workspace = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(indptr, indices, last_len, q_heads, kv_heads, head_dim, BLOCK_TOKENS,
                 q_data_type=torch.float16, kv_data_type=kv_dtype)
    q = torch.randn(batch, q_heads, head_dim, device="cuda", dtype=torch.float16)
    ms = time_ms(torch, lambda: wrapper.run(q, cache), iters, flush)
    nbytes = cache.numel() * cache.element_size() + q.numel() * 2 * 2
    return {"ms": ms, "bytes": nbytes, "tbps": nbytes / (ms * 1e-3) / 1e12}


def cmd_run(args):
    import torch

    buffer = torch.zeros(256 << 20, device="cuda", dtype=torch.uint8)
    words = buffer.view(torch.int32)
    # "read": a reduction over the buffer leaves the L2 holding its clean lines; "write": zeroing
    # it leaves dirty lines whose write-back falls inside the next timed run.
    flush = buffer.zero_ if args.l2_flush == "write" else words.sum
    geo = (args.q_heads, args.kv_heads, args.head_dim)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "q_heads": geo[0], "kv_heads": geo[1], "head_dim": geo[2],
              "iters": args.iters, "l2_flush": args.l2_flush,
              "gqa": "enable_gqa=True (K/V not expanded)", "cases": []}
    try:
        import flashinfer
        result["flashinfer"] = getattr(flashinfer, "__version__", "?")
    except Exception as e:  # recorded, not fatal: the anchor is SDPA
        flashinfer = None
        result["flashinfer"] = None
        result["flashinfer_unavailable"] = f"{type(e).__name__}: {e}; " + args.flashinfer_note
    for batch, context in parse_shapes(args.shapes):
        case = {"batch": batch, "context": context,
                "sdpa_flash_fp16": run_sdpa(torch, geo, batch, context, args.iters, flush)}
        if flashinfer is not None:
            for name, dt in (("flashinfer_fp16", torch.float16),
                             ("flashinfer_fp8", torch.float8_e4m3fn)):
                try:
                    case[name] = run_flashinfer(torch, flashinfer, geo, batch, context, dt,
                                                args.iters, flush)
                except Exception as e:
                    case[name] = {"error": f"{type(e).__name__}: {e}"}
        result["cases"].append(case)
        print(batch, context, {k: v.get("ms") for k, v in case.items() if isinstance(v, dict)},
              flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


def cmd_merge(args):
    with open(args.kvpool) as f:
        kv = json.load(f)
    with open(args.peer) as f:
        peer = json.load(f)
    anchors = {(c["batch"], c["context"]): c for c in peer["cases"]}
    timed = {"kvpool": kv, "peer": peer}
    if args.flashinfer and peer.get("flashinfer") is None:
        with open(args.flashinfer) as f:
            fi = json.load(f)
        timed["flashinfer"] = fi
        peer["flashinfer"] = f"{fi['flashinfer']}, C++ kernels built into {fi['tool']}"
        peer.pop("flashinfer_unavailable", None)
        for c in fi["cases"]:
            case = anchors.get((c["batch"], c["context"]))
            if case is not None:
                case.update({k: c[k] for k in FLASHINFER_VARIANTS if k in c})
    # Files from before the --l2_flush flag were timed after a zeroing flush.
    flushes = {name: d.get("l2_flush", "write") for name, d in timed.items()}
    if len(set(flushes.values())) > 1:
        sys.exit(f"attention_peer.py merge: timed after different L2 flushes: {flushes}")
    geometries = {name: geometry(d) for name, d in timed.items()}
    if len(set(geometries.values())) > 1:
        sys.exit(f"attention_peer.py merge: different geometries (q heads, KV heads, head_dim): "
                 f"{geometries}")
    unanchored = sorted({(c["batch"], c["context"]) for c in kv["cases"]} - anchors.keys())
    if unanchored:
        sys.exit(f"attention_peer.py merge: kvpool cases without an anchor (batch, context): "
                 f"{unanchored}")
    with_targets = geometry(kv) == ISSUE_GEOMETRY
    rows = []
    for c in kv["cases"]:
        p = anchors[(c["batch"], c["context"])]
        anchor_ms = p["sdpa_flash_fp16"]["ms"]
        row = dict(c)
        row["sdpa_flash_fp16_ms"] = anchor_ms
        row["speedup_vs_sdpa"] = anchor_ms / c["ms"]
        for peer_name in FLASHINFER_VARIANTS:
            if "ms" in p.get(peer_name, {}):
                row[peer_name + "_ms"] = p[peer_name]["ms"]
                row["speedup_vs_" + peer_name] = p[peer_name]["ms"] / c["ms"]
        target = TARGETS.get(c["format"]) if with_targets else None
        if target is not None:
            row["speedup_target"] = target
            row["speedup_met"] = row["speedup_vs_sdpa"] >= target
        if with_targets and c["format"] == "int4_rot128":
            row["stream_target"] = INT4_STREAM_TARGET
            row["stream_met"] = c["frac_stream"] >= INT4_STREAM_TARGET
        rows.append(row)
    # When the file was made: render_tables.py shows the newest.
    merged = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "kvpool": {k: v for k, v in kv.items() if k != "cases"},
              "peer": {k: v for k, v in peer.items() if k != "cases"},
              "anchor": "sdpa_flash_fp16", "cases": rows}
    with open(args.out, "w") as f:
        json.dump(merged, f, indent=1)
    print(f"{'batch':>5} {'ctx':>6} {'format':<12} {'ms':>8} {'sdpa ms':>8} {'x sdpa':>7} "
          f"{'stream':>7}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>6} {r['format']:<12} {r['ms']:>8.4f} "
              f"{r['sdpa_flash_fp16_ms']:>8.4f} {r['speedup_vs_sdpa']:>7.2f} "
              f"{100 * r['frac_stream']:>6.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--iters", type=int, default=25)
    r.add_argument("--l2_flush", choices=("read", "write"), default="read")
    r.add_argument("--q_heads", type=int, default=ISSUE_GEOMETRY[0])
    r.add_argument("--kv_heads", type=int, default=ISSUE_GEOMETRY[1])
    r.add_argument("--head_dim", type=int, default=ISSUE_GEOMETRY[2])
    r.add_argument("--shapes", default=SHAPES, help="<batch>x<context>, comma-separated")
    r.add_argument("--flashinfer-note", default="", help="why FlashInfer is absent, if known")
    m = sub.add_parser("merge")
    m.add_argument("--kvpool", required=True)
    m.add_argument("--peer", required=True)
    m.add_argument("--flashinfer", help="flashinfer_decode_bench's JSON, if it ran")
    m.add_argument("--out", required=True)
    args = ap.parse_args()
    return cmd_run(args) if args.cmd == "run" else cmd_merge(args)


if __name__ == "__main__":
    sys.exit(main())
