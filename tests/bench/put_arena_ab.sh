#!/usr/bin/env bash
# Measures put_arena_bench builds against each other in one call on the GPU machine: each round
# runs every LABEL=BINARY once, the order rotated by one from round to round (so that no build
# always follows the same one), --rounds times (default 6), with the same arguments; then prints
# per build and token count the medians of the runs' Put medians, their range and the sampled
# error. Output: $OUT/put_ab.txt (every run's stdout, headed "== LABEL round R").
#   tests/bench/put_arena_ab.sh [--rounds=N] LABEL=BINARY... -- [put_arena_bench arguments]
set -uo pipefail
source tests/bench/carry_env.sh
carry_setup
parse_builds 6 "$@"
status=0
n=${#builds[@]}
for ((r = 0; r < rounds; ++r)); do
  for ((i = 0; i < n; ++i)); do
    build=${builds[$(((i + r) % n))]}
    label=${build%%=*}
    echo "== $label round $((r + 1))" >> "$out/put_ab.txt"
    "${build#*=}" "${bench_args[@]}" >> "$out/put_ab.txt" 2>&1 || { echo "$label round $((r + 1)) failed" >&2; status=1; }
  done
done
python3 - "$out/put_ab.txt" <<'PY'
import collections, re, statistics, sys
runs, errors, label, tokens = collections.defaultdict(list), {}, None, None
for line in open(sys.argv[1]):
    m = re.match(r'== (\S+) round', line)
    if m:
        label = m.group(1)
        continue
    f = line.split()
    if len(f) == 8 and f[0].isdigit():
        tokens = int(f[0])
        runs[(label, tokens)].append(float(f[3]))
    elif 'EWMA' in line:
        errors[(label, tokens)] = f[-1]
print('build  tokens  median of Put medians ms  range ms  sampled error')
for (label, tokens), v in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f'{label}  {tokens}  {statistics.median(v):.3f}  {min(v):.3f}-{max(v):.3f}  '
          f'{errors.get((label, tokens), "-")}')
PY
exit $status
