#!/usr/bin/env bash
# Runs the accuracy test (CPU reference kernels, tests/kernels/accuracy_test.cc) and records its
# table as tests/bench/results/accuracy_cpu.json with date, commit, machine and command line.
# usage: tests/bench/record_accuracy.sh [build-dir]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:-$root/build}
raw=$(mktemp)
KVPOOL_ACCURACY_JSON=$raw "$build/accuracy_test"
python3 - "$raw" "$root/tests/bench/results/accuracy_cpu.json" <<'PY'
import json, platform, subprocess, sys, datetime, os
data = json.load(open(sys.argv[1]))
root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(sys.argv[2]))))
commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"],
                        capture_output=True, text=True).stdout.strip()
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "commit": commit, "machine": f"{platform.node()} {cpu}",
       "command": "tests/bench/record_accuracy.sh", **data}
json.dump(out, open(sys.argv[2], "w"), indent=1)
print("wrote", sys.argv[2])
PY
