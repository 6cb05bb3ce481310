#!/usr/bin/env bash
# Decode attention at other models' geometries, on the GPU machine: for each geometry below,
# attention_bench (every page format), the PyTorch SDPA anchor and, when it is packed,
# flashinfer_decode_bench (its tensor-core path at every geometry below, its CUDA-core path at
# GQA groups 1, 2, 3, 4 and 8), over the same six (batch, context) shapes as the issue's
# benchmark, merged into $OUT/attention_geometry_<name>.json (attention_peer.py merge; the issue's
# targets are set for 32 q / 8 KV heads / head_dim 128 only, so these files carry ratios without
# met/missed flags).
# render_tables.py prints them.
#   tests/bench/attention_geometries.sh <commit> [name ...]   (default: every geometry)
set -uo pipefail
commit=${1:-unknown}
shift
source tests/bench/carry_env.sh
carry_setup
# name: q heads, KV heads, head_dim (the model whose attention layers have it)
declare -A geometries=(
  [llama3_70b]="64 8 128"   # Llama-3-70B: GQA 8, one 8-head CTA per KV head
  [qwen25_7b]="28 4 128"    # Qwen2.5-7B: GQA 7
  [llama2_7b]="32 32 128"   # Llama-2-7B: multi-head attention, GQA 1
  [llama32_1b]="32 8 64"    # Llama-3.2-1B: head_dim 64
  [gemma2_9b]="16 8 256"    # Gemma-2-9B: head_dim 256, GQA 2
)
names=("$@")
((${#names[@]})) || names=(llama3_70b qwen25_7b llama2_7b llama32_1b gemma2_9b)
status=0
for name in "${names[@]}"; do
  [[ -n ${geometries[$name]:-} ]] || { echo "unknown geometry $name" >&2; status=2; continue; }
  read -r q kv hd <<< "${geometries[$name]}"
  geo=(--q_heads="$q" --kv_heads="$kv" --head_dim="$hd")
  echo "== $name: $q q heads, $kv KV heads, head_dim $hd"
  "$bin/attention_bench" --commit="$commit" "${geo[@]}" --out="$tmp/$name.kvpool.json" \
    > "$out/attention_geometry_$name.txt" 2>&1 || { status=1; continue; }
  python3 tests/bench/attention_peer.py run "${geo[@]}" --out="$tmp/$name.peer.json" \
    >> "$out/attention_geometry_$name.txt" 2>&1 || { status=1; continue; }
  fi_args=()
  if [[ -x $bin/flashinfer_decode_bench ]]; then
    "$bin/flashinfer_decode_bench" --commit="$commit" "${geo[@]}" \
      --out="$tmp/$name.flashinfer.json" >> "$out/attention_geometry_$name.txt" 2>&1 \
      && fi_args=(--flashinfer "$tmp/$name.flashinfer.json") || status=1
  fi
  python3 tests/bench/attention_peer.py merge --kvpool "$tmp/$name.kvpool.json" \
    --peer "$tmp/$name.peer.json" "${fi_args[@]}" --out "$out/attention_geometry_$name.json" \
    || status=1
done
exit $status
