#!/usr/bin/env python3
"""Counts the SASS instructions of a kernel's main loop, the figure the attention experiments
(results/experiments_2026-11-29.md) and the README quote per tile.

The loop of the tensor-core split kernel runs from its first wait on cp.async groups with some
still in flight (DEPBAR.LE SB0, 0x1..) to the wait for all of them after the loop
(DEPBAR.LE SB0, 0x0). The count includes both copy paths and the rarely taken rescale branch.

usage (nvdisasm from the CUDA toolkit or `pip install nvidia-cuda-nvdisasm`):
  nvcc -std=c++17 -arch=sm_90 -cubin -O3 -I. -o int4.cubin kernels/cuda/paged_attention_int4.cu
  nvdisasm -c int4.cubin | python3 tests/bench/sass_loop_count.py AttentionSplitMmaKernel Li128ELi1
"""
import collections
import re
import sys


def main():
    needles = sys.argv[1:]
    text = sys.stdin.read()
    parts = re.split(r"//-+ \.text\.(\S+) -+", text)
    for name, body in zip(parts[1::2], parts[2::2]):
        if not all(n in name for n in needles):
            continue
        lines = [l for l in body.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", l)]
        start = next(i for i, l in enumerate(lines) if re.search(r"DEPBAR\.LE SB0, 0x[1-9]", l))
        end = next(i for i in range(start, len(lines)) if "DEPBAR.LE SB0, 0x0" in lines[i])
        ops = collections.Counter()
        for l in lines[start:end]:
            m = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", l)
            if m:
                ops[m.group(1)] += 1
        print(f"{name}: {end - start} loop instructions of {len(lines)}")
        print("  " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))


if __name__ == "__main__":
    main()
