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
