#!/usr/bin/env bash
# Downloads Intel MKL's runtime libraries (the `mkl` wheel from the Python
# package index) and unpacks the ones `anetrain` loads into DIR, then prints
# the line to export. anetrain finds MKL at run time (never at build time):
#
#   scripts/fetch_mkl.sh [DIR]          # default: target/mkl
#   export ANETRAIN_MKL=DIR/libmkl_rt.so.3
#   cargo run --release -- info         # "matrix multiply: Intel MKL ..."
#
# Needs python3 with pip. About 230 MB to download, 430 MB unpacked.
# MKL is Intel's, under the Intel Simplified Software License.
set -euo pipefail
dir=${1:-target/mkl}
version=${MKL_VERSION:-2026.2.1}
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps "mkl==$version" -d "$tmp"
python3 - "$tmp" "$dir" <<'PY'
import glob, os, shutil, sys, zipfile
src, dst = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(src, "mkl-*.whl"))[0]
# The single dynamic library, its core, the sequential threading layer, the
# LP64 interface, and the per-CPU kernels it picks from at run time.
keep = ("libmkl_rt.", "libmkl_core.", "libmkl_sequential.", "libmkl_intel_lp64.",
        "libmkl_def.", "libmkl_mc3.", "libmkl_avx2.", "libmkl_avx512.", "libmkl_avx10.")
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        base = os.path.basename(name)
        if "/lib/" in name and base.startswith(keep):
            with z.open(name) as f, open(os.path.join(dst, base) + ".part", "wb") as out:
                shutil.copyfileobj(f, out)
            os.replace(os.path.join(dst, base) + ".part", os.path.join(dst, base))
PY
lib=$(ls "$dir"/libmkl_rt.so.* | head -1)
echo "export ANETRAIN_MKL=$(cd "$(dirname "$lib")" && pwd)/$(basename "$lib")"
