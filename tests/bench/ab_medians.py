#!/usr/bin/env python3
"""Medians per case of the runs tests/bench/alternate.sh wrote (LABEL.ROUND.json of
attention_bench or quantize_bench), each label against the first one given (default: "base").

usage: python3 tests/bench/ab_medians.py OUT_DIR [BASE_LABEL]
"""
import collections
import glob
import json
import os
import statistics
import sys


def case_key(case):
    return tuple(case[k] for k in ("batch", "context", "format", "dtype", "rot_block") if k in case)


def main():
    out, base = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "base"
    ms = collections.defaultdict(list)
    for path in glob.glob(os.path.join(out, "*.*.json")):
        label = os.path.basename(path).split(".")[0]
        for case in json.load(open(path))["cases"]:
            ms[(case_key(case), label)].append(case["ms"])
    labels = sorted({label for _, label in ms}, key=lambda l: (l != base, l))
    if base not in labels:
        sys.exit(f"no runs labelled {base} under {out}")
    for key in sorted({key for key, _ in ms}):
        b = statistics.median(ms[(key, base)])
        row = [f"{' '.join(map(str, key)):32s} {base} {b * 1e3:8.2f} us"]
        for label in labels[1:]:
            if (key, label) in ms:
                row.append(f"{label} {100 * (statistics.median(ms[(key, label)]) / b - 1):+5.1f}%")
        print("  ".join(row))


if __name__ == "__main__":
    main()
