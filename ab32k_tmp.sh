set -uo pipefail
tar -xJf carry.tar.xz; export LD_LIBRARY_PATH=$PWD/carry/lib
tmp=$(mktemp -d); grpc=$OUT/ab32k.txt; status=0
source tests/bench/grpc_bench_lib.sh
for side in change base change; do
  bin=$(mktemp -d); ln -s $PWD/carry/bin/kvpool $bin/kvpool
  ln -s $PWD/carry/bin/kvpool-server$([[ $side == base ]] && echo _base) $bin/kvpool-server
  echo "== $side" | tee -a $grpc
  start_server
  timed_attend AttendStream.step "AttendStream steps" --batch=1 --context=32768 --iters=300 --stream
  stop_server
done
