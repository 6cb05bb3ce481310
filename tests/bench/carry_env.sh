# Sourced by the scripts that run packed binaries on the GPU machine (packed by
# tests/gpu/package_for_device.sh). carry_setup [lib_dir]: sets $out ($OUT or ./out, created), $tmp
# (a scratch folder) and $bin (carry/bin), unpacks carry.tar.xz unless carry/ is there, and puts
# carry/lib, then lib_dir if given, first on LD_LIBRARY_PATH.
carry_setup() {
  out=${OUT:-out}
  tmp=$(mktemp -d)
  mkdir -p "$out"
  [[ -d carry ]] || tar -xJf carry.tar.xz
  export LD_LIBRARY_PATH=$PWD/carry/lib${1:+:$1}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  bin=$PWD/carry/bin
}

# parse_builds ROUNDS ARGS...: the arguments of the scripts that measure builds against each
# other (alternate.sh, put_arena_ab.sh), [--rounds=N] LABEL=BINARY... -- [benchmark arguments].
# Sets $rounds (ROUNDS unless --rounds is given), the array builds (LABEL=BINARY) and the array
# bench_args (what follows --); exits 2 on anything else.
parse_builds() {
  rounds=$1
  shift
  builds=()
  while (($#)); do
    case $1 in
      --rounds=*) rounds=${1#--rounds=} ;;
      --) shift; break ;;
      *=*) builds+=("$1") ;;
      *) echo "$(basename "$0"): expected LABEL=BINARY, got $1" >&2; exit 2 ;;
    esac
    shift
  done
  bench_args=("$@")
}
