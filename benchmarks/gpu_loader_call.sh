#!/usr/bin/env bash
# The loader's whole GPU measurement, in two device calls (docs/benchmarks.md, "The chunk
# loop through the daemon"): the page-cache writer's variants (a thread's tasks in one call,
# the C loop a chunk at a time, Python staging; each with the hash off too), InstantTensor's
# paths in fresh processes (MMAP, BUFFERED, MMAP with its registration), the daemon end to
# end at each load_chunk_loop, the staging probe, the GPU tests of the loops, and churn
# with the C loop a chunk at a time against a thread's tasks in one call, alternating.
# Results and logs go to $1 (default: results/gpu-loader-call); a summary is printed. The
# timeouts inside keep each part under a 10-minute call (300 + 40 + 240 s; 4 x 130 s):
#
#     bash benchmarks/gpu_loader_call.sh "$OUT" loader
#     bash benchmarks/gpu_loader_call.sh "$OUT" churn
set -u
out=${1:-results/gpu-loader-call}
part=${2:-loader}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
lscpu | grep -iE "model name|L3|^CPU\(s\)"
make native > /dev/null || exit 1

if [ "$part" = churn ]; then
  for loop in c tasks c tasks; do
    timeout 130 python3 -m benchmarks profile-loads --workdir /tmp/wc-prof --chunk-loop $loop \
      --out "$out/churn-$loop-$RANDOM.json" > "$out/churn-$loop.log" 2>&1
    echo "profile-loads $loop: rc=$?"
    grep -E "^churn" "$out/churn-$loop.log" | awk '{print $3, $4}' | sort \
      | awk '{a[$1] = a[$1] " " $2} END {for (k in a) print "  churn", k, a[k], "ms"}'
  done
  exit 0
fi
cc -O2 -pthread -o /tmp/staging_probe benchmarks/native/staging_probe.c -ldl || exit 1

timeout 300 python3 -m benchmarks loader-paths --size-gib 9.15 --tensors 183 --threads 12 --chunk-mib 16 --depths 1 \
  --loops tasks,c,python --nohash --reps 3 --anchors \
  --anchor-kinds instanttensor_mmap,instanttensor_buffered,instanttensor_mmap_registered \
  --daemon 12:py,12,12:tasks --out "$out/loader-paths.json" > "$out/loader-paths.log" 2>&1
echo "loader-paths: rc=$?"
grep -E "^(instanttensor|load_file|daemon)" "$out/loader-paths.log" | cut -c1-160
sed -n '/"best_GBps"/,$p' "$out/loader-paths.log" | tail -25
timeout 40 /tmp/staging_probe /tmp/wc-loader-paths/paths-9.15g.safetensors pread 2 12 3 2 > "$out/probe.jsonl" 2>&1
echo "probe: rc=$?"; cat "$out/probe.jsonl"

timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py \
  -k "loop or fingerprint or deep or truncated or evicted" > "$out/gpu-tests.log" 2>&1
echo "gpu tests: rc=$?"; tail -3 "$out/gpu-tests.log"

