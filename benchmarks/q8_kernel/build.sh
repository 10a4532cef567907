#!/bin/sh
set -e
cd "$(dirname "$0")"
INC=$(python -c "import jax; print(jax.ffi.include_dir())")
g++ -O3 -shared -fPIC -std=c++17 -ffp-contract=off -Wno-attributes -Wno-return-type \
    -I"$INC" q8matmul.cc -o libq8matmul.so
