#!/usr/bin/env python3
"""Prints the README's result tables (markdown) from the JSON files in tests/bench/results/.

usage: python3 tests/bench/render_tables.py [--suites] [results-dir]
Each table names the file, date, commit and machine it came from; nothing here is typed by hand.
--suites prints one row per suite call (tests/bench/device_suite.sh) found in results-dir instead:
how the figures moved between calls.
"""
import json
import pathlib
import re
import sys

SUITES = "--suites" in sys.argv[1:]
_ARGS = [a for a in sys.argv[1:] if a != "--suites"]
RESULTS = pathlib.Path(_ARGS[0] if _ARGS else pathlib.Path(__file__).resolve().parent / "results")


def load(name):
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def accuracy():
    d = load("accuracy_cpu.json")
    if not d:
        return
    cols = ["int4_naive", "int4_rot16", "int4_rot32", "int4_rot64", "int4_rot128", "int8_rot128",
            "fp8_rot128", "fp16"]
    print(f"Attention-output relative L2 error vs fp64 attention over the original K/V "
          f"({d['tokens']} tokens, head_dim {d['head_dim']}, median of {d['seeds']} seeds; "
          f"`{d['command']}`, {d['date']}, commit {d['commit']}, {d['machine']}):\n")
    print("| generator | " + " | ".join(cols) + " | naive / rot128 |")
    print("|---" * (len(cols) + 2) + "|")
    for gen, row in d["errors"].items():
        ratio = row["int4_naive"] / row["int4_rot128"]
        print(f"| {gen} | " + " | ".join(f"{row[c]:.4f}" for c in cols) + f" | {ratio:.2f}x |")
    print()


def quantize():
    d = load("quantize_h200.json")
    if not d:
        return
    print(f"Fused quantize-append, {d['geometry']['input_bytes'] / 2**30:.0f} GiB of fp16 K+V "
          f"({d['geometry']['kv_heads']} heads x {d['geometry']['head_dim']}), median of "
          f"{d['runs']} runs; streaming copy measured in the same run: "
          f"{d['streaming_copy']['gbps']:.0f} GB/s (`{d['command']}`, {d['date']}, commit "
          f"{d['commit']}, {d['gpu']}):\n")
    clocks = "sm_mhz_before" in d["cases"][0]
    print("| dtype | rotation block | ms | GB/s | of streaming copy |"
          + (" SM MHz before / after |" if clocks else ""))
    print("|---" * (6 if clocks else 5) + "|")
    for c in d["cases"]:
        print(f"| {c['dtype']} | {c['rot_block'] or 'none'} | {c['ms']:.3f} | {c['gbps']:.0f} | "
              f"{100 * c['fraction_of_copy']:.1f}% |"
              + (f" {c['sm_mhz_before']:.0f} / {c['sm_mhz_after']:.0f} |" if clocks else ""))
    inter = d.get("rotation_overhead_interleaved")
    print(f"\nRotation overhead (INT4 rotation 128 vs none): "
          f"{100 * d['rotation_overhead_int4_rot128_vs_rot0']:+.1f}% (cases measured in turn)"
          + (f"; {100 * inter['overhead']:+.1f}% over {inter['pairs']} pairs of the two launched "
             f"one after the other (median per-pair ratio; medians {inter['rot0_ms']:.3f} / "
             f"{inter['rot128_ms']:.3f} ms)" if inter else "") + ".\n")
    if inter and "full_clock" in inter:
        def part(name, c):
            if not c["pairs"]:
                return f"no pair {name}"
            return (f"{c['pairs']} pairs {name}: rot128 {c['rot128_ms']:.3f} ms, "
                    f"{100 * c['overhead']:+.1f}%")
        print(f"SM clock probes around the pairs (rated {d['rated_sm_mhz']:.0f} MHz; medians "
              f"{inter['rot0_sm_mhz']:.0f} MHz before rot0, {inter['rot128_sm_mhz']:.0f} MHz "
              f"before rot128): {part('at full clock', inter['full_clock'])}; "
              f"{part('at a lower clock', inter['lower_clock'])} (full clock: both probes "
              f"around the rot128 launch at >= {inter['full_clock_mhz']:.0f} MHz).\n")


def flashinfer_best_ms(case, kv_dtype):
    """The faster of FlashInfer's two paths (CUDA-core and tensor-core) on a merged case, or None
    when FlashInfer did not run."""
    times = [case.get(f"flashinfer{path}_{kv_dtype}_ms") for path in ("", "_tc")]
    times = [t for t in times if t is not None]
    return min(times) if times else None


# attention_bench --l2_flush; files from before the flag were timed after a zeroing flush.
FLUSH_NAMES = {"read": "a read of 256 MiB", "write": "zeroing 256 MiB"}


def attention():
    # The newest merged file: by its "date" (attention_peer.py merge), then by name (files from
    # before the date was written). A suite directory holds it as attention.json.
    dated = [(json.loads(p.read_text()).get("date", ""), p.name, p)
             for p in [*RESULTS.glob("attention_2*.json"), *RESULTS.glob("attention.json")]]
    if not dated:
        return
    *_, path = max(dated)
    d = json.loads(path.read_text())
    k = d["kvpool"]
    # Files from before attention_bench timed an empty launch have no floor.
    floor = (f", an empty launch timed the same way {1e3 * k['launch_floor_ms']:.1f} µs"
             if "launch_floor_ms" in k else "")
    print(f"Decode attention, {k.get('q_heads', 32)} q heads / {k['kv_heads']} KV heads, "
          f"head_dim {k['head_dim']}, "
          f"block_tokens {k['block_tokens']}, median of {k['iters']} runs, each after an L2 flush by "
          f"{FLUSH_NAMES[k.get('l2_flush', 'write')]}; anchor PyTorch "
          f"{d['peer'].get('torch', '?')} SDPA flash fp16 ({d['peer'].get('gqa', '')}) in the same "
          f"file; streaming read {k['stream_read_tbps']:.2f} TB/s{floor} ({path.name}, commit "
          f"{k['commit']}, {k['device']}):\n")
    rows = {}
    for c in d["cases"]:
        rows.setdefault((c["batch"], c["context"]), {})[c["format"]] = c
    print("| batch x context | SDPA fp16 ms | INT4 (rot 128) ms | INT4 x SDPA | INT4 of stream. read "
          "| INT8 x SDPA | FP8 x SDPA | FP16 paged x SDPA | error INT4 rot 128 / naive |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (batch, ctx), f in rows.items():
        i4, nv = f["int4_rot128"], f["int4_naive"]
        print(f"| {batch} x {ctx // 1024}K | {i4['sdpa_flash_fp16_ms']:.3f} | {i4['ms']:.4f} | "
              f"{i4['speedup_vs_sdpa']:.2f}x | {100 * i4['frac_stream']:.0f}% | "
              f"{f['int8_rot128']['speedup_vs_sdpa']:.2f}x | {f['fp8_rot128']['speedup_vs_sdpa']:.2f}x | "
              f"{f['fp16']['speedup_vs_sdpa']:.2f}x | "
              f"{i4['rel_err_vs_fp16_mean']:.3f} / {nv['rel_err_vs_fp16_mean']:.3f} |")
    if d["peer"].get("flashinfer_unavailable"):
        print(f"\nFlashInfer: not measured — {d['peer']['flashinfer_unavailable']}.")
    elif all("flashinfer_tc_fp16_ms" in c for c in d["cases"]):
        print(f"\nAgainst FlashInfer's paged decode in the same run ({d['peer']['flashinfer']}), "
              f"16-token pages; CUDA-core kernel (the wrapper's default) and tensor-core path "
              f"(use_tensor_cores=True), ms, and kvpool's speed-up over the faster of the two:\n")
        print("| batch x context | FlashInfer fp16 ms (CUDA cores / tensor cores) | FlashInfer fp8 "
              "ms (CUDA cores / tensor cores) | INT4 x FlashInfer fp16 | FP8 x FlashInfer fp8 "
              "| FP16 paged x FlashInfer fp16 |")
        print("|---|---|---|---|---|---|")
        for (batch, ctx), f in rows.items():
            i4, f8, f16 = f["int4_rot128"], f["fp8_rot128"], f["fp16"]
            best16 = flashinfer_best_ms(i4, "fp16")
            best8 = flashinfer_best_ms(i4, "fp8")
            print(f"| {batch} x {ctx // 1024}K | {i4['flashinfer_fp16_ms']:.4f} / "
                  f"{i4['flashinfer_tc_fp16_ms']:.4f} | {i4['flashinfer_fp8_ms']:.4f} / "
                  f"{i4['flashinfer_tc_fp8_ms']:.4f} | {best16 / i4['ms']:.2f}x | "
                  f"{best8 / f8['ms']:.2f}x | {best16 / f16['ms']:.2f}x |")
    print()


# attention_geometries.sh: the model each file's geometry comes from.
GEOMETRY_MODELS = {"llama3_70b": "Llama-3-70B", "qwen25_7b": "Qwen2.5-7B",
                   "llama2_7b": "Llama-2-7B", "llama32_1b": "Llama-3.2-1B",
                   "gemma2_9b": "Gemma-2-9B"}


def geometries():
    def name(path):
        return path.stem[len("attention_geometry_"):]
    order = list(GEOMETRY_MODELS)
    files = sorted(RESULTS.glob("attention_geometry_*.json"),
                   key=lambda p: (order.index(name(p)) if name(p) in order else len(order), name(p)))
    if not files:
        return
    ds = [(p, json.loads(p.read_text())) for p in files]
    k0 = ds[0][1]["kvpool"]
    print(f"Decode attention at other models' geometries (`tests/bench/attention_geometries.sh`): "
          f"the six shapes above, block_tokens {k0['block_tokens']}, median of {k0['iters']} runs "
          f"after L2 flushes, anchor SDPA flash fp16 at the same geometry in the same run; rotated "
          f"formats rotate blocks of min(128, head_dim); FlashInfer: the faster of its two paths, as "
          f"above (only the tensor-core one at GQA groups its CUDA-core decode does not dispatch, "
          f"Qwen2.5-7B's 7), where its file was merged. Files "
          + ", ".join(f"{p.name} ({d['date']}, commit {d['kvpool']['commit']})" for p, d in ds)
          + f", {k0['device']}:\n")
    print("| model (q / KV heads, head_dim) | batch x context | SDPA fp16 ms | INT4 ms | INT4 x SDPA "
          "| INT4 of stream. read | INT8 x SDPA | FP8 x SDPA | FP16 paged x SDPA "
          "| INT4 x FlashInfer fp16 | FP8 x FlashInfer fp8 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")

    def over_flashinfer(c, kv_dtype):
        best = flashinfer_best_ms(c, kv_dtype)
        return f"{best / c['ms']:.2f}x" if best is not None else "-"
    for p, d in ds:
        k = d["kvpool"]
        model = (f"{GEOMETRY_MODELS.get(name(p), name(p))} ({k['q_heads']} / {k['kv_heads']}, "
                 f"{k['head_dim']})")
        rows = {}
        for c in d["cases"]:
            fmt = c["format"].split("_")[0] if "_rot" in c["format"] or c["format"] == "fp16" \
                else None
            if fmt:
                rows.setdefault((c["batch"], c["context"]), {})[fmt] = c
        for (batch, ctx), f in rows.items():
            i4 = f["int4"]
            print(f"| {model} | {batch} x {ctx // 1024}K | {i4['sdpa_flash_fp16_ms']:.3f} | "
                  f"{i4['ms']:.4f} | {i4['speedup_vs_sdpa']:.2f}x | {100 * i4['frac_stream']:.0f}% | "
                  f"{f['int8']['speedup_vs_sdpa']:.2f}x | {f['fp8']['speedup_vs_sdpa']:.2f}x | "
                  f"{f['fp16']['speedup_vs_sdpa']:.2f}x | {over_flashinfer(i4, 'fp16')} | "
                  f"{over_flashinfer(f['fp8'], 'fp8')} |")
            model = ""
    print()


# attend_latency_bench's JSON: attend_latency_h200.json at the top, attend_latency.json in a
# suite call's folder (device_suite.sh).
ATTEND_LATENCY_FILES = ("attend_latency_h200.json", "attend_latency.json")


def load_attend_latency():
    for name in ATTEND_LATENCY_FILES:
        d = load(name)
        if d:
            return name, d
    return None, None


def attend_latency():
    name, d = load_attend_latency()
    if not d:
        return
    print(f"Attend's server time in process, p50 / p99 µs over {d['iters']} calls "
          f"(`tests/gpu/attend_latency_bench.cc`, {name}, commit {d['commit']}, "
          f"NVIDIA H200):\n")
    # Columns that later versions of the benchmark added show when the file has them.
    pinned_append = any("pinned_append_p50_us" in c for c in d["cases"])
    layers = d.get("kernel_layers") if any("kernel_append_layers_p50_us" in c
                                           for c in d["cases"]) else None
    print("| batch x context | AttendRunner | KvStore::Attend | decode step (with append) "
          "| KvStore::Attend, q and out pinned |"
          + (" decode step, q, out and new K/V pinned |" if pinned_append else "")
          + " CUDA backend call | same, q and out pinned "
          "| same, with an append | bare kernels (p50) | bare kernels with the append (p50) |"
          + (f" same, {layers} layers in turn (p50) |" if layers else ""))
    print("|---" * (10 + pinned_append + bool(layers)) + "|")

    def pair(c, key):
        return f"{c[key + '_p50_us']:.0f} / {c[key + '_p99_us']:.0f}" if key + "_p50_us" in c \
            else "-"
    for c in d["cases"]:
        ctx = f"{c['context'] // 1024}K" if c["context"] >= 1024 else str(c["context"])
        print(f"| {c['batch']} x {ctx} | {pair(c, 'runner')} | {pair(c, 'store')} | "
              f"{pair(c, 'append')} | {pair(c, 'pinned')} | "
              + (f"{pair(c, 'pinned_append')} | " if pinned_append else "")
              + f"{pair(c, 'backend')} | "
              f"{pair(c, 'backend_pinned')} | {pair(c, 'backend_append')} | "
              f"{c['kernel_p50_us']:.0f} | {c.get('kernel_append_p50_us', float('nan')):.0f} |"
              + (f" {c['kernel_append_layers_p50_us']:.0f} |" if layers else ""))
    print()


def nccl():
    d = load("nccl.json")
    if not d:
        return
    before = load("nccl_before_pipelining_h200x2.json")
    old = {(r["path"], r["format"], r["bytes"]): r for r in (before or {}).get("results", [])}
    raw = {r["bytes"]: r["median_ms"] for r in d["results"] if r["path"] == "raw"}
    # The pipelining comparison, where its earlier file lies beside this one.
    print(f"NCCL data plane, server on GPU 0 and worker process on GPU 1, median of {d['reps']} "
          f"runs (`{d['command']}`, {d['date']}, commit {d['commit']}, 2 x {d['server_gpu']}"
          + (f"; before: nccl_before_pipelining_h200x2.json, commit {before['commit']}" if before
             else "") + "):\n")
    print("| path | format | MiB | ms | GB/s | of raw send/recv, same bytes |"
          + (" before: ms |" if before else ""))
    print("|---" * (7 if before else 6) + "|")
    for r in d["results"]:
        frac = (f"{raw[r['bytes']] / r['median_ms']:.1%}"
                if r["path"] == "get" and r["bytes"] in raw else "")
        prev = old.get((r["path"], r["format"], r["bytes"]))
        prev_ms = f" {prev['median_ms']:.3f} |" if prev else " |"
        print(f"| {r['path']} | {r['format']} | {r['bytes'] / 2**20:.0f} | {r['median_ms']:.3f} | "
              f"{r['gbps']:.1f} | {frac} |" + (prev_ms if before else ""))
    print()


# `kvpool bench attend` runs of device_suite.sh, by what the tool prints they timed.
ATTEND_TRANSPORTS = {
    "unary RPCs": "unary",
    "AttendStream steps": "AttendStream",
    "AttendSocket steps": "AttendSocket (TCP)",
    "AttendSocket region steps": "region, session copies",
    "AttendSocket in-place region steps": "region, in place",
}
APPEND_STEPS = "AttendSocket in-place region steps with a new token each"


def attend_runs(text):
    """Each `kvpool bench attend` run of a grpc_bench.txt: (batch, context, what it timed, p50,
    p99, the server's mean µs per call), from the run's line and the server-time line after it."""
    return re.findall(r"bench attend: batch (\d+) x (\d+) context tokens, \d+ q heads, \d+ "
                      r"(.+?): p50 (\d+) us, p99 (\d+) us\nserver time: mean (\d+) us", text)


def grpc():
    path = RESULTS / "grpc_bench.txt"
    if not path.exists():
        return
    text = path.read_text()
    puts = re.findall(r"bench put: (\d+) streams, .*?, (\d+) tokens/message\) in [\d.]+ s: "
                      r"([\d.]+) GB/s", text)
    print("Put ingest over gRPC loopback, GB/s of fp16 K/V (32 layers, 1024-token sequences, every "
          f"token new; `kvpool bench put`, {path.name}):\n")
    sizes = sorted({int(m) for _, m, _ in puts})
    print("| Put streams | " + " | ".join(f"{m} tokens/message" for m in sizes) + " |")
    print("|---" * (len(sizes) + 1) + "|")
    rates = {(int(n), int(m)): float(g) for n, m, g in puts}
    for n in sorted({n for n, _ in rates}):
        print(f"| {n} | " + " | ".join(f"{rates.get((n, m), float('nan')):.2f}" for m in sizes)
              + " |")
    runs = attend_runs(text)
    lat_name, lat = load_attend_latency()
    kernels = {(c["batch"], c["context"]): c for c in (lat or {}).get("cases", [])}

    def shape(batch, context):
        return f"{batch} x {context // 1024}K" if context % 1024 == 0 else f"{batch} x {context}"

    def cell(r):
        return f"{r[3]} / {r[4]} ({r[5]})"
    table = {}
    for r in runs:
        if r[2] in ATTEND_TRANSPORTS:
            table.setdefault((int(r[0]), int(r[1])), {})[ATTEND_TRANSPORTS[r[2]]] = cell(r)
    print(f"\nAttend over loopback, 32 q heads, p50 / p99 µs per call (server's mean µs per call), "
          f"{path.name}; bare kernels from {lat_name}:\n")
    cols = list(ATTEND_TRANSPORTS.values())
    print("| batch x context | " + " | ".join(cols) + " | bare kernels p50 |")
    print("|---" * (len(cols) + 2) + "|")
    for (batch, context), row in table.items():
        k = kernels.get((batch, context))
        print(f"| {shape(batch, context)} | " + " | ".join(row.get(c, "-") for c in cols)
              + f" | {k['kernel_p50_us'] if k else '-'} |")
    appends = [r for r in runs if r[2] == APPEND_STEPS]
    if appends:
        print("\nDecode steps that append each item's new token first, in place (the tool appends "
              "10 tokens before timing, so the context printed is 10 over the lease's; bare "
              "kernels: the append's quantize kernel and the attention):\n")
        print("| batch x context | in place, with appends | bare kernels with the append p50 |")
        print("|---|---|---|")
        for r in appends:
            batch, context = int(r[0]), int(r[1])
            k = kernels.get((batch, context - 10))
            print(f"| {shape(batch, context - 10)} + appends | {cell(r)} | "
                  f"{k['kernel_append_p50_us'] if k else '-'} |")
    print()


SHAPES = ((1, 32768), (8, 8192), (8, 32768), (32, 4096), (32, 16384), (64, 8192))


def suites():
    """One row per suite call: a suite_<commit>/ directory or an attention_*_suite_<commit>.json
    file (calls from before the suite wrote its own directory)."""
    calls = {}
    for p in RESULTS.glob("attention_*_suite_*.json"):
        calls.setdefault(p.stem.rsplit("_", 1)[1], {})["attention"] = p
    for d in RESULTS.glob("suite_*"):
        c = calls.setdefault(d.name[len("suite_"):], {})
        for name, key in (("attention.json", "attention"), ("grpc_bench.txt", "grpc"),
                          ("attend_latency.json", "latency")):
            if (d / name).exists():
                c[key] = d / name
    rows = []
    int4_ms, sdpa_ms, over_fi = {}, {}, {"int4_rot128": [], "fp8_rot128": []}
    for commit, files in calls.items():
        if "attention" not in files:
            continue
        d = json.loads(files["attention"].read_text())
        cases = {(c["batch"], c["context"], c["format"]): c for c in d["cases"]}
        for b, t in SHAPES:
            int4 = cases[(b, t, "int4_rot128")]
            int4_ms.setdefault((b, t), []).append(int4["ms"])
            sdpa_ms.setdefault((b, t), []).append(int4["sdpa_flash_fp16_ms"])
        for fmt, key in (("int4_rot128", "speedup_vs_flashinfer_tc_fp16"),
                         ("fp8_rot128", "speedup_vs_flashinfer_tc_fp8")):
            over_fi[fmt] += [cases[(b, t, fmt)][key] for b, t in SHAPES
                             if key in cases[(b, t, fmt)]]

        def per_shape(fmt, key, fmt_str):
            return " / ".join(fmt_str.format(cases[(b, t, fmt)][key]) for b, t in SHAPES)
        over = {}
        if "grpc" in files and "latency" in files:
            kernels = {(c["batch"], c["context"]): c
                       for c in json.loads(files["latency"].read_text())["cases"]}
            for b, t, what, p50, *_ in attend_runs(files["grpc"].read_text()):
                b, t = int(b), int(t)
                if what == APPEND_STEPS:
                    k = kernels.get((b, t - 10), {}).get("kernel_append_p50_us")
                    what, t = "appends", t - 10
                else:
                    k = kernels.get((b, t), {}).get("kernel_p50_us")
                if k is not None:
                    over[(b, t, what)] = int(p50) - k
        cells = [over.get(key) for key in ((1, 32768, "unary RPCs"),
                                           (1, 32768, "AttendStream steps"),
                                           (32, 4096, "AttendSocket in-place region steps"),
                                           (32, 4096, "appends"))]
        rows.append((d.get("date") or "", commit, per_shape("int4_rot128", "speedup_vs_sdpa",
                     "{:.2f}"), per_shape("int4_rot128", "frac_stream", "{:.0%}"),
                     per_shape("fp8_rot128", "speedup_vs_sdpa", "{:.2f}"),
                     per_shape("fp16", "speedup_vs_sdpa", "{:.2f}"),
                     " / ".join("-" if v is None else f"{v:.0f}" for v in cells)))
    print("Suite calls (`tests/bench/device_suite.sh`), oldest first; shapes 1 x 32K / 8 x 8K / "
          "8 x 32K / 32 x 4K / 32 x 16K / 64 x 8K; Attend: p50 µs over the bare kernels of the "
          "same call, unary and AttendStream at 1 x 32K, in place and in place with appends at "
          "32 x 4K:\n")
    print("| date | commit | INT4 x SDPA | INT4 of stream. read | FP8 x SDPA | FP16 paged x SDPA "
          "| Attend over kernels, µs |")
    print("|---|---|---|---|---|---|---|")
    for date, *cols in sorted(rows):
        print(f"| {date or '-'} | " + " | ".join(cols) + " |")

    def spread(times):  # per shape: (slowest - fastest) / fastest; the range over the shapes
        moved = [max(v) / min(v) - 1 for v in times.values()]
        return f"{min(moved):.1%}-{max(moved):.1%}"
    print(f"\nOver these {len(rows)} calls, per shape: INT4 rot128's time moved by "
          f"{spread(int4_ms)}, SDPA's by {spread(sdpa_ms)}; INT4 x FlashInfer's tensor-core fp16 "
          f"{min(over_fi['int4_rot128']):.2f}-{max(over_fi['int4_rot128']):.2f}x, FP8 x its fp8 "
          f"{min(over_fi['fp8_rot128']):.2f}-{max(over_fi['fp8_rot128']):.2f}x.")
    print()


if __name__ == "__main__" and SUITES:
    suites()
elif __name__ == "__main__":
    accuracy()
    quantize()
    attention()
    geometries()
    attend_latency()
    nccl()
    grpc()
