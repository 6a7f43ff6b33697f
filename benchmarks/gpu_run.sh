#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks/, one section per lent-machine call (each well inside 10 minutes).
# Results land in $OUT (the device tool brings them back); run from the repository root:
#   bash benchmarks/gpu_run.sh bench     # one H200: GPU tests, step profile, routing, drafter GEMMs by M, `peagle bench`
#   bash benchmarks/gpu_run.sh gpu-tests # one H200: every GPU test (bench runs them under a 280 s cut)
#   bash benchmarks/gpu_run.sh ab        # one H200: decode-step profiles of this tree against an earlier commit's
#   bash benchmarks/gpu_run.sh bench-first  # one H200: `peagle bench`, the step profile, then GPU tests in the time left
#   bash benchmarks/gpu_run.sh mxfp4     # one GPU: MXFP4 GPU tests, `peagle bench` (20B and 120B MXFP4), MoE tiles
#   bash benchmarks/gpu_run.sh moe-tiles # one GPU: MoE launch shapes by token count
#   bash benchmarks/gpu_run.sh fp16-probe  # one GPU: the MXFP4 GEMV with codes re-encoded for a bit-mask FP4 -> fp16 expansion
#   bash benchmarks/gpu_run.sh gemv      # one GPU: the CUDA-core MXFP4 GEMVs against the MMA kernels, layer and 120B step
#   bash benchmarks/gpu_run.sh gemv-f16  # one GPU: the GEMVs' fp16 pairs against an earlier tree's GEMVs (BASE), layer and 120B step
#   bash benchmarks/gpu_run.sh moe-where # one GPU: the 120B MXFP4 MoE layer's kernels, its bytes read by pattern, its step's kernels
#   bash benchmarks/gpu_run.sh spec-120b # one GPU: speculation at the 120B MXFP4 shape (replayed acceptance), per-user tok/s
#   bash benchmarks/gpu_run.sh spec-120b-repeat  # one GPU: spec-120b's 4- and 16-request levels again; 1 request in two rounds
#   bash benchmarks/gpu_run.sh prefix-ttft  # one GPU: TTFT with a shared 2,048-token prefix, prefix cache on / off
#   bash benchmarks/gpu_run.sh skinny    # one H200: the attention projections, cuBLAS against the skinny Triton GEMM
#   bash benchmarks/gpu_run.sh pair-tp   # two H200s: the tiny pair's heads, then TP=1 vs TP=2 (20B shape)
#   bash benchmarks/gpu_run.sh tp-sweep  # two H200s: bf16 TP agreement with sharp logits, then `adaptive`
#   bash benchmarks/gpu_run.sh pair-pretrain  # one H200: a longer-trained tiny target (carry data/tiny_tokens.pt.xz)
#   bash benchmarks/gpu_run.sh pair-heads  # two H200s: regenerate ~37k responses, then both heads (carry data/big)
#   bash benchmarks/gpu_run.sh peagle-layers  # two H200s (or one: head A): the same responses, then P-EAGLE heads (LAYERS_A/B, EXTRA_A/B)
#   bash benchmarks/gpu_run.sh pair-finetune  # one GPU: the same responses (REGEN_DIR), then both shipped heads continued with EXTRA
#   bash benchmarks/gpu_run.sh adaptive  # one GPU: adaptive-depth sweep, 20B shape (replayed acceptance), two calls
#   bash benchmarks/gpu_run.sh adaptive-x2  # two GPUs: the same sweep in one call, its levels split over the GPUs
#   bash benchmarks/gpu_run.sh tp-graphs  # two H200s: TP=2 with CUDA graphs, tests and TP=1/TP=2 step times
#   bash benchmarks/gpu_run.sh tp-allreduce  # two H200s: a TP=2 step's all-reduces alone, and their share of it
#   bash benchmarks/gpu_run.sh tp-paths  # two H200s: NCCL's transport between the GPUs; symmetric-memory one-shot
#   bash benchmarks/gpu_run.sh adaptive-tiny   # one H200: the tiny pair's sweep (real acceptance; carry data/heldout.json)
#   bash benchmarks/gpu_run.sh train-profile   # one H200: where a head-training step's time goes (carry data/regen.jsonl)
#   bash benchmarks/gpu_run.sh train-speed     # one H200: head-training step times, eager and compiled (carry it too)
# The image lacks pydantic: benchmarks/device_wheels.sh fetches the wheels into .whl/ (carry it). pair-tp,
# pair-heads (as a fallback), train-profile and train-speed also need data/regen.jsonl
# (scripts/tiny/train_pair.py --stop-after regen, on any machine; carry it too).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}; mkdir -p "$OUT"
if [ -d .whl ] && ! PYTHONPATH=/tmp/site python3 -c "import pydantic" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=$PWD:$PWD/kernels:$PWD/cluster:$PWD/loadtest:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
sweep20b() {  # OUT_DIR CONCURRENCY: the 20B-shape sweep of `adaptive`, by default the settings of the run
             # docs/benchmarks/adaptive.md cites (the environment overrides them; TRACE: the acceptance trace replayed)
  timeout "${SWEEP_TIMEOUT:-540}" python3 benchmarks/adaptive_sweep.py sweep --shape 20b --device cuda \
    --replay "${TRACE:-benchmarks/traces/tiny_peagle_k7_stage3.json}" --concurrency "$2" --waves "${WAVES:-6}" \
    --min-requests "${MIN_REQUESTS:-64}" --rounds "${ROUNDS:-3}" --max-tokens "${MAX_TOKENS:-64}" --prewarm-policy adaptive \
    --policies "${POLICIES:-K7,K3,adaptive,K5}" --time-budget-s "${SWEEP_BUDGET:-370}" \
    ${SWEEP_ARGS---warm-policy --warmup-steps 32} --out "$1"
}
report20b() {  # DIR: its sweep.{json,md,png} as the files docs/benchmarks/adaptive.md cites (copy them there)
  for ext in json md png; do cp "$1/sweep.$ext" "$OUT/adaptive_20b_stage3_uniform.$ext" 2>/dev/null; done
}
QUIET="C=\|leaked\|nanobind\|skipped remainder"
# spec-120b's engine: the 120B MXFP4 shape, acceptance replayed at conditional rates 0.80..0.45 (synthetic)
SPEC120=(--shape 120b --device cuda --replay synthetic:0.80,0.72,0.66,0.60,0.55,0.50,0.45 --waves 2 --max-tokens 64
         --warm-policy --kv-cache-gb 4)  # per-cell lines and Triton's exit noise: the [bar] lines stay last
GPU_TESTS="tests/test_kernels_attention.py tests/test_kernels_moe.py tests/test_kernels_moe_mxfp4.py
           tests/test_kernels_routing.py tests/test_kernels_spec.py tests/test_kernels_norm_rope.py tests/test_graphs.py
           tests/test_training.py tests/test_timing.py"

train_heads() {  # train_heads DIR [train_pair args]: both tiny heads into DIR; its log and a tarball into $OUT
  local dir=$1 name; name=$(basename "$1"); shift
  PEAGLE_TRITON=0 timeout "${HEADS_TIMEOUT:-330}" python3 scripts/tiny/train_pair.py \
    --target "${TARGET:-peagle_core/assets/tiny/target}" --regen-data "${REGEN_DATA:-data/regen.jsonl}" --stop-after heads \
    --out "$dir" "$@" \
    > "$OUT/$name.log" 2>&1
  tail -n 3 "$OUT/$name.log"
  tar czf "$OUT/$name.tgz" -C "$dir" peagle eagle3 peagle_train.jsonl eagle3_train.jsonl train_report.json
}

NGPU=$(nvidia-smi -L | wc -l)
regen_big() {  # every GPU: the target answers data/big's prompts (one shard a GPU) into /tmp/regen_big.jsonl.
  # The prompts split into REGEN_SHARDS shards (default: one a GPU); GPU i answers shard REGEN_FIRST + i, so calls
  # on one GPU can take disjoint prompts (REGEN_SHARDS=2, REGEN_FIRST=0 then 1). REGEN_TOKENS: answer length (160).
  # data/big.tar.xz (`tar cJf data/big.tar.xz -C data big`, 2 MB instead of 11) leaves room in the carry for heads.
  # REGEN_DIR: another prompt folder of prepare_data.py's (default data/big), or its DIR.tar.xz
  local dir=${REGEN_DIR:-data/big}
  [ -d "$dir" ] || tar xJf "$dir.tar.xz" -C "$(dirname "$dir")" || return 1
  local shards=${REGEN_SHARDS:-$NGPU} first=${REGEN_FIRST:-0}
  if ((first + NGPU > shards)); then echo "regen_big: shards $first..$((first + NGPU - 1)) of $shards do not exist" >&2; return 1; fi
  for ((i = 0; i < NGPU; i++)); do
    CUDA_VISIBLE_DEVICES=$i timeout "${REGEN_TIMEOUT:-220}" python3 scripts/tiny/train_pair.py --data "$dir" \
      --target "${TARGET:-peagle_core/assets/tiny/target}" --out "/tmp/regen$i" --stop-after regen --regen-prompts 100000 --regen-tokens "${REGEN_TOKENS:-160}" \
      --regen-shard "$((first + i))/$shards" --regen-minutes "${REGEN_MINUTES:-2.2}" --regen-batch 512 \
      > "$OUT/regen$i.log" 2>&1 &
  done
  wait
  tail -n 2 "$OUT"/regen?.log
  local files=(); for ((i = 0; i < NGPU; i++)); do files+=("/tmp/regen$i/regen.jsonl"); done  # this call's only
  grep -h '}$' "${files[@]}" > /tmp/regen_big.jsonl  # whole records only
  [ "$(wc -l < /tmp/regen_big.jsonl)" -ge 2000 ] || cp data/regen.jsonl /tmp/regen_big.jsonl  # (carry it)
  wc -l /tmp/regen_big.jsonl
}

case "${1:-}" in
  bench)  # one H200: GPU tests (the graph tests first: the 280 s cut the last run at 74%), where a bs-1 step's
           # time goes, then `peagle bench`; `gpu-tests` runs all of them with the whole call's time
    timeout 280 python3 -m pytest -v -p no:cacheprovider -m gpu --durations=20 tests/test_graphs.py \
      $(echo $GPU_TESTS | tr ' ' '\n' | grep -v test_graphs) > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 12
    # --pdl: the decode graph again with PEAGLE_PDL=1 (programmatic dependent launch; an estimated 10-20 s more,
    # compiling the PDL variants of the kernels at the 20B shape); the GPU tests above already ran every kernel with it
    timeout 150 python3 benchmarks/profile_step.py --pdl --out "$OUT" 2>&1 | grep -v "^USDT\|^STAGE" | tail -n 9
    timeout 170 python3 -m peagle_core.cli bench --shape 20b --device cuda --out "$OUT" 2>&1 | tail -n 40
    ;;
  ab)  # one H200: a change's decode-step profile against an earlier commit's, in one call. BASE: that commit's code
       # (`git archive -o data/base.tgz REV kernels peagle_core ':(exclude)peagle_core/assets'`, carried); rounds of
       # `profile_step.py --graphs-only --skip-draft $AB_ARGS` (e.g. "--shape 120b --mxfp4"), base then this tree,
       # with the GPU tests of AB_TESTS between the first round and the rest; AB_VARIANTS: more runs of this tree,
       # ';'-separated "name:env...:profile args"
       mkdir -p /tmp/base/benchmarks && tar xzf "${BASE:-data/base.tgz}" -C /tmp/base || exit 1
       cp benchmarks/profile_step.py /tmp/base/benchmarks/  # (the flags; it imports the code beside it)
       ab_profile() {  # ab_profile NAME DIR [ENV...] [-- ARGS...]
         local name=$1 dir=$2 envs=() ; shift 2
         while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done; [ "${1:-}" = -- ] && shift
         (cd "$dir" && env PYTHONPATH="$dir:$dir/kernels:$dir/cluster:$dir/loadtest:/tmp/site" "${envs[@]}" timeout "${AB_TIMEOUT:-120}" python3 \
           benchmarks/profile_step.py --graphs-only --skip-draft ${AB_ARGS:-} "$@" --out "/tmp/ab/$name") 2>&1 \
           | grep -v "^USDT\|^STAGE" | sed "s/^/$name: /" | tail -n 3
       }
       ab_profile base_1 /tmp/base; ab_profile new_1 "$PWD"
       timeout "${AB_TESTS_TIMEOUT:-200}" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=10 \
         ${AB_TESTS:-$GPU_TESTS} > "$OUT/gpu_tests.log" 2>&1
       grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 12
       for ((r = 2; r <= ${AB_ROUNDS:-2}; r++)); do ab_profile "base_$r" /tmp/base; ab_profile "new_$r" "$PWD"; done
       IFS=';' read -ra variants <<< "${AB_VARIANTS:-}"
       for v in "${variants[@]}"; do
         IFS=':' read -r vname venv vargs <<< "$v"
         ab_profile "$vname" "$PWD" $venv -- $vargs
       done
       tar czf "$OUT/ab.tgz" -C /tmp ab
       ;;
  bench-first)  # one H200: `peagle bench` first, then where the bs-1 step goes (graphs; PROFILE_ARGS adds flags,
                # e.g. a second run with --max-kv-splits 1), then the GPU tests of BENCH_TESTS in the time left
    timeout "${BENCH_TIMEOUT:-220}" python3 -m peagle_core.cli bench --shape 20b --device cuda --out "$OUT" 2>&1 | tail -n 30
    timeout 120 python3 benchmarks/profile_step.py --graphs-only --out /tmp/profile 2>&1 | grep -v "^USDT\|^STAGE" | tail -n 4
    cp /tmp/profile/profile.json "$OUT/profile.json"; cp /tmp/profile/profile.md "$OUT/profile.md"
    [ -z "${PROFILE_ARGS:-}" ] || { timeout 100 python3 benchmarks/profile_step.py --graphs-only --skip-draft $PROFILE_ARGS \
      --out /tmp/profile2 2>&1 | grep -v "^USDT\|^STAGE" | tail -n 2; cp /tmp/profile2/profile.json "$OUT/profile_args.json"; }
    timeout "${TESTS_TIMEOUT:-200}" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=10 \
      ${BENCH_TESTS:-$GPU_TESTS} > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 12
    ;;
  gpu-tests)  # one H200: every GPU test, with their durations
    timeout 560 python3 -m pytest -v -p no:cacheprovider -m gpu --durations=30 $GPU_TESTS > "$OUT/gpu_tests.log" 2>&1
    grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 40
    ;;
  skinny)  # one H200: the attention projections at decode sizes, cuBLAS against the skinny Triton GEMM's launch shapes
    timeout "${SKINNY_TIMEOUT:-150}" python3 benchmarks/skinny_linear.py --out "$OUT" 2>&1 | tail -n 12
    ;;
  mxfp4)  # one GPU: the MXFP4 GPU tests, `peagle bench` (20B bf16 and MXFP4, 120B MXFP4), the MoE layer by tiles
    timeout 120 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_kernels_moe_mxfp4.py 2>&1 | tail -n 3
    timeout 330 python3 -m peagle_core.cli bench --shape 20b --device cuda --skip-hf --out "$OUT/bench" \
      > /tmp/bench.log 2>&1; tail -n 24 /tmp/bench.log
    timeout "${MOE_TIMEOUT:-150}" python3 benchmarks/moe_tiles.py --out "$OUT" --max-t 256 --layers 120b-mxfp4,20b-mxfp4 \
      > /tmp/moe_tiles.log 2>&1; tail -n 16 /tmp/moe_tiles.log
    ;;
  fp16-probe)  # one GPU: the re-encoded MXFP4 GEMV (FP4 -> fp16 by bit masks) against the layer's own kernels;
               # BASE_KERNEL: an earlier triton_moe_mxfp4.py whose layer is timed beside this tree's (carry it)
    timeout 300 python3 benchmarks/mxfp4_fp16_probe.py --out "$OUT" ${BASE_KERNEL:+--base "$BASE_KERNEL"} \
      > "$OUT/probe.log" 2>&1; grep -v "^{" "$OUT/probe.log" | tail -n 60
    ;;
  gemv)  # one GPU: the CUDA-core MXFP4 GEMV kernels (PEAGLE_MXFP4_DECODE=gemv) against the MMA kernels: the MoE
         # layer by launch shape at 1-16 tokens (120B and 20B), the 120B decode and verify steps' kernels with the
         # GEMVs and then with the MMA kernels, then the MXFP4 GPU tests in the time left
    timeout "${MOE_TIMEOUT:-170}" python3 benchmarks/moe_tiles.py --out "$OUT/tiles" --max-t 16 --tokens 1,2,4,8,16 \
      --layers "${GEMV_LAYERS:-120b-gemv,20b-gemv}" > "$OUT/tiles.log" 2>&1; grep -v "^{" "$OUT/tiles.log" | tail -n 40
    for mode in ${GEMV_MODES:-gemv mma}; do
      PEAGLE_MXFP4_DECODE=$mode timeout "${PROFILE_TIMEOUT:-140}" python3 benchmarks/profile_step.py --shape 120b --mxfp4 \
        --graphs-only --skip-draft --bandwidth-tb-s 3.1 --out "$OUT/profile_$mode" 2>&1 | grep -v "^USDT\|^STAGE" | tail -n 3
    done
    timeout "${TESTS_TIMEOUT:-120}" python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_kernels_moe_mxfp4.py \
      2>&1 | tail -n 5
    ;;
  gemv-f16)  # one GPU: this tree's MXFP4 GEMVs against an earlier commit's (BASE: `git archive -o data/base.tgz REV
             # kernels peagle_core ':(exclude)peagle_core/assets'`, carried): the GEMV GPU tests, the MoE layer at 1-32
             # tokens by launch shape (120B, 20B; the base tree's shipped shapes alone; 40-64 tokens this tree's only), then the
             # 120B step's kernels
    mkdir -p /tmp/base/benchmarks && tar xzf "${BASE:-data/base.tgz}" -C /tmp/base || exit 1
    cp benchmarks/moe_tiles.py /tmp/base/benchmarks/  # (its flags; it imports the kernels beside it)
    timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_kernels_moe_mxfp4.py \
      -k "gemv or graph" 2>&1 | tail -n 5
    tiles_args=(--max-t 64 --tokens "${GEMV_TOKENS:-1,2,4,8,16,24,32}" --layers 120b-gemv,20b-gemv)
    timeout "${MOE_TIMEOUT:-200}" python3 benchmarks/moe_tiles.py --out "$OUT/tiles" "${tiles_args[@]}" \
      --max-candidates "${GEMV_CANDIDATES:-7}" > "$OUT/tiles.log" 2>&1; grep -v "^{" "$OUT/tiles.log" | tail -n 16
    timeout "${WIDE_TIMEOUT:-60}" python3 benchmarks/moe_tiles.py --out "$OUT/tiles_wide" --max-t 64 --tokens 40,48,64 \
      --layers 120b-gemv,20b-gemv --max-candidates 5 > "$OUT/tiles_wide.log" 2>&1; grep -v "^{" "$OUT/tiles_wide.log" | tail -n 6
    (cd /tmp/base && PYTHONPATH=/tmp/base:/tmp/base/kernels:/tmp/site timeout "${BASE_TIMEOUT:-100}" python3 \
      benchmarks/moe_tiles.py --out "$OUT/tiles_base" "${tiles_args[@]}" --max-candidates 3 > "$OUT/tiles_base.log" 2>&1)
    grep -v "^{" "$OUT/tiles_base.log" | tail -n 16
    timeout "${PROFILE_TIMEOUT:-140}" python3 benchmarks/profile_step.py --shape 120b --mxfp4 --graphs-only --skip-draft \
      --bandwidth-tb-s 3.1 --out "$OUT/profile" 2>&1 | grep -v "^USDT\|^STAGE" | tail -n 3
    ;;
  moe-where)  # one GPU: where the 120B MXFP4 MoE layer's time goes (its kernels), its bytes read by access pattern
              # (benchmarks/mxfp4_stream.py), wider K-steps, then the 120B MXFP4 step's kernels (with and without PDL)
    timeout 150 python3 benchmarks/mxfp4_stream.py --out "$OUT" > "$OUT/stream.log" 2>&1; tail -n 8 "$OUT/stream.log"
    timeout 120 python3 benchmarks/moe_tiles.py --out "$OUT/tiles" --max-t 64 --layers 120b-wide --tokens 1,8 \
      > "$OUT/tiles.log" 2>&1; tail -n 4 "$OUT/tiles.log"
    timeout 240 python3 benchmarks/profile_step.py --shape 120b --mxfp4 --graphs-only --skip-draft --pdl \
      --bandwidth-tb-s 3.1 --out "$OUT/profile" 2>&1 | grep -v "^USDT\|^STAGE" | tail -n 4
    ;;
  spec-120b)  # one GPU: issue 51's speculation end to end at the 120B MXFP4 shape, acceptance replayed at the
              # conditional rates 0.80..0.45 per position (synthetic, benchmark only): per-user tok/s at concurrency 1,
              # 4 and 16 for no speculation, P-EAGLE K = 3, 5, 7 and adaptive, then EAGLE-3 K = 3
    local_args=("${SPEC120[@]}" --concurrency 1,4,16 --min-requests 4)
    timeout "${SPEC_TIMEOUT:-340}" python3 benchmarks/adaptive_sweep.py sweep "${local_args[@]}" \
      --policies none,K3,K5,K7,adaptive --time-budget-s "${SPEC_BUDGET:-250}" --out /tmp/spec120 \
      > "$OUT/spec120.log" 2>&1; grep -v "$QUIET" "$OUT/spec120.log" | tail -n 12
    timeout "${SPEC_E3_TIMEOUT:-170}" python3 benchmarks/adaptive_sweep.py sweep "${local_args[@]}" --mode eagle3 \
      --policies K3 --out /tmp/spec120_eagle3 > "$OUT/spec120_eagle3.log" 2>&1; grep -v "$QUIET" "$OUT/spec120_eagle3.log" | tail -n 6
    tar czf "$OUT/spec120.tgz" -C /tmp spec120 spec120_eagle3
    ;;
  spec-120b-repeat)  # one GPU: spec-120b's 4- and 16-request levels again with the GEMVs through 64 tokens (adaptive
                     # first), then its one-request level in two rounds (one engine build each, Triton's compiles
                     # shared): if adaptive's ~25 ms k = 0 steps (the drafter's eager catch-up) are first-use compiles,
                     # round 2's are near a decode step
    timeout "${C16_TIMEOUT:-220}" python3 benchmarks/adaptive_sweep.py sweep "${SPEC120[@]}" --concurrency 4,16 \
      --min-requests 4 --policies adaptive,none,K3,K7 --out "$OUT/c16" > "$OUT/c16.log" 2>&1
    grep -v "$QUIET" "$OUT/c16.log" | tail -n 6
    timeout "${C1_TIMEOUT:-150}" python3 benchmarks/adaptive_sweep.py sweep "${SPEC120[@]}" --concurrency 1 \
      --min-requests 6 --rounds 2 --policies adaptive,none,K3 --out "$OUT/c1" > "$OUT/c1.log" 2>&1
    grep -v "$QUIET" "$OUT/c1.log" | tail -n 4
    rm -rf "$OUT/c1/cells" "$OUT/c16/cells"
    ;;
  prefix-ttft)  # one GPU: TTFT with a 2,048-token shared prefix, prefix caching on against off (20B shape)
    timeout 300 python3 benchmarks/prefix_ttft.py --shape 20b --prefix 2048 --concurrency 4 --waves 4 --rounds 1 \
      --out "$OUT" 2>&1 | grep -v "leaked\|nanobind\|skipped remainder" | tail -n 8
    ;;
  moe-tiles)  # one GPU: MoE launch shapes by token count (docs/benchmarks/moe_tiles.*), the MXFP4 GPU tests
    timeout 330 python3 benchmarks/moe_tiles.py --out "$OUT" ${MOE_ARGS:-} > /tmp/moe_tiles.log 2>&1; tail -n 25 /tmp/moe_tiles.log
    timeout 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/test_kernels_moe_mxfp4.py 2>&1 | tail -n 5
    ;;
  pair-tp)  # two H200s: the tiny pair's heads (one GPU each), then TP=1 vs TP=2 at the 20B shape
    train_heads /tmp/pair --head-steps 4000 --head-minutes "${HEAD_MINUTES:-4}"
    timeout 250 python3 -m peagle_core.parallel_bench --shape 20b --tp 2 --device cuda --batch-sizes 1,8,32 \
      --context 1024 --out "$OUT" 2>&1 | tail -n 30
    ;;
  tp-sweep)  # two H200s: graph tests, the bf16 TP=1/TP=2 agreement with sharp logits, then the adaptive sweep
    timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 tests/test_graphs.py 2>&1 \
      | tail -n 60 > "$OUT/graph_tests.log"
    tail -n 12 "$OUT/graph_tests.log"
    timeout 200 python3 -m peagle_core.parallel_bench --shape 20b --tp 2 --device cuda --batch-sizes 1,8 \
      --context 1024 --scale 30 --out "$OUT/tp" 2>&1 | tail -n 16
    SWEEP_TIMEOUT=${SWEEP_TIMEOUT:-250} SWEEP_BUDGET=${SWEEP_BUDGET:-150} bash "$0" adaptive
    ;;
  adaptive)  # one GPU: the 20B-shape sweep (acceptance replayed), after an unmeasured pass that compiles every shape;
             # ROUNDS interleaved rounds (cells: the median), at least MIN_REQUESTS requests per level; SWEEP_ARGS:
             # more sweep flags (later ones win; the default "--warm-policy --warmup-steps 32" when unset). It prints
             # the bar per concurrency ([bar] lines: adaptive >= 0.97 x the best fixed K, above K7 where K7 is not
             # best) and leaves $OUT/adaptive_20b_stage3_uniform.{json,md,png}. The whole sweep takes two calls: the
             # first stops starting policies after SWEEP_BUDGET s; carry its cells/ (from sweep20b.tgz) and give
             # SWEEP_CELLS=that dir: the second call keeps them (--resume), runs the rest and writes the whole table.
             # On two GPUs, `adaptive-x2` runs it in one call
    if [ -n "${SWEEP_CELLS:-}" ]; then
      mkdir -p /tmp/sweep20b/cells && cp "$SWEEP_CELLS"/*.json /tmp/sweep20b/cells/ && SWEEP_ARGS="${SWEEP_ARGS---warm-policy --warmup-steps 32} --resume"
    fi
    sweep20b /tmp/sweep20b "${CONCURRENCY:-1,2,4,8,16,32,64}" 2>&1 | tee "$OUT/sweep20b.log" | grep -v "$QUIET" | tail -n 12
    report20b /tmp/sweep20b
    tar czf "$OUT/sweep20b.tgz" -C /tmp sweep20b
    ;;
  adaptive-x2)  # two GPUs: the `adaptive` sweep with its levels split over the GPUs, run side by side (CONC0 on
                # GPU 0, CONC1 on GPU 1: each level's cells, adaptive and fixed alike, on one GPU), then one report
                # and its [bar] lines, as `adaptive` leaves them
    for i in 0 1; do
      conc=$([ "$i" = 0 ] && echo "${CONC0:-1,2,4,8}" || echo "${CONC1:-16,32,64}")
      CUDA_VISIBLE_DEVICES=$i sweep20b "/tmp/sweep20b_$i" "$conc" > "$OUT/sweep20b_$i.log" 2>&1 &
    done
    wait
    python3 benchmarks/adaptive_sweep.py merge /tmp/sweep20b_0 /tmp/sweep20b_1 --out /tmp/sweep20b 2>&1 | grep -v "$QUIET"
    grep -h "time budget\|Error\|error" "$OUT"/sweep20b_?.log | tail -n 6
    report20b /tmp/sweep20b
    tar czf "$OUT/sweep20b.tgz" -C /tmp sweep20b sweep20b_0 sweep20b_1
    ;;
  tp-graphs)  # two H200s: TP=2 with CUDA graphs (the tiny pair's GPU tests; TP_TESTS_K selects some), then unless
              # TP_BENCH=0 TP=1 vs TP=2, graphs and eager, at the 20B shape
    timeout "${TP_TESTS_TIMEOUT:-240}" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=5 tests/test_tp.py \
      ${TP_TESTS_K:+-k "$TP_TESTS_K"} 2>&1 | tail -n 40 > "$OUT/tp_tests.log"
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tp_tests.log" | tail -n 8
    [ "${TP_BENCH:-1}" = 0 ] || { timeout "${TP_TIMEOUT:-370}" python3 -m peagle_core.parallel_bench --shape 20b \
      --tp 2 --device cuda --batch-sizes 1,8,32 --context 1024 --out "$OUT/tp" 2>&1 | tail -n 16
      TP_STEPS="$OUT/tp/summary.json" bash "$0" tp-allreduce; }
    ;;
  tp-allreduce)  # two H200s: one decode step's all-reduces alone, in a CUDA graph, and their share of the TP=2
                 # step (TP_STEPS: a parallel_bench summary; default the committed one, docs/benchmarks/tp/)
    timeout 150 python3 benchmarks/allreduce_bench.py --shape 20b --tp 2 --device cuda --batch-sizes 1,8,32 \
      --step-times "${TP_STEPS:-docs/benchmarks/tp/graphs_20b.json}" --out "$OUT/tp" 2>&1 | tail -n 8
    ;;
  tp-paths)  # two H200s: how NCCL connects the GPUs (its INFO log's transport lines) and the symmetric-memory
             # one-shot all-reduce beside NCCL's, at the 20B shape's all-reduce sizes
    mkdir -p "$OUT/tp_paths"
    NCCL_DEBUG=INFO timeout "${PATHS_TIMEOUT:-150}" python3 benchmarks/allreduce_bench.py --shape 20b --tp 2 --device cuda \
      --batch-sizes 1,8,32 --symm-mem --out "$OUT/tp_paths" > /tmp/tp_paths.log 2>&1
    grep -E " via |NCCL version|P2P" /tmp/tp_paths.log | sed 's/^[^ ]* //' | sort | uniq -c | head -n 30 \
      > "$OUT/tp_paths/nccl_transport.txt"
    tail -n 16 /tmp/tp_paths.log
    ;;
  adaptive-tiny)  # one H200: the shipped tiny pair's sweep on its own held-out prompts (real acceptance). Defaults as
                  # in adaptive_tiny_shared (~6 minutes): levels long enough to measure, one engine a round shared
                  # by the policies (builds differ in host speed more than the policies do);
                  # SWEEP_ARGS= (set, empty) builds an engine per policy instead; paired episodes (the same requests
                  # for every policy): ROUNDS=2 WAVES=3 MIN_REQUESTS=0 SWEEP_ARGS="--paired 10 --warm-policy
                  # --warmup-steps 32 --prewarm-policy=" (~3.5 minutes)
    timeout "${SWEEP_TIMEOUT:-455}" python3 benchmarks/adaptive_sweep.py sweep --shape tiny --device cuda \
      --prompts heldout --concurrency 1,2,4,8,16,32,64 --waves "${WAVES:-6}" --min-requests "${MIN_REQUESTS:-64}" \
      --rounds "${ROUNDS:-4}" \
      --max-tokens "${MAX_TOKENS:-128}" --prewarm-policy adaptive --policies "${POLICIES:-K7,K3,adaptive,K5,K1}" \
      --time-budget-s "${SWEEP_BUDGET:-390}" ${SWEEP_ARGS---shared-engine} --out /tmp/sweep_tiny 2>&1 \
      | tee "$OUT/sweep_tiny.log" | grep -v "C=" | tail -n 12
    tar czf "$OUT/sweep_tiny.tgz" -C /tmp sweep_tiny
    ;;
  pair-pretrain)  # one H200: a longer-trained tiny target (carry data/tiny_tokens.pt.xz: `xz -k data/tiny_tokens.pt`,
                  # as the 27 MB tokens and the tracked tree pass the 64 MiB carry limit). Its checkpoint comes back in
                  # 15 MB parts (16 MiB a file): `cat target.tgz.* | tar xz -C data` gives data/target; for
                  # pair-heads copy its weights over peagle_core/assets/tiny/target/ for the call (29 MB more
                  # does not fit the carry; tracked files travel) and restore them after (tiny_heads.md)
    [ -f data/tiny_tokens.pt ] || python3 -c "import lzma, shutil; shutil.copyfileobj(lzma.open('data/tiny_tokens.pt.xz'), open('data/tiny_tokens.pt', 'wb'))" || exit 1
    timeout "${PRETRAIN_TIMEOUT:-560}" python3 scripts/tiny/pretrain.py --tokens data/tiny_tokens.pt --out /tmp/target \
      --minutes "${PRETRAIN_MINUTES:-8.5}" > "$OUT/pretrain.log" 2>&1
    tail -n 3 "$OUT/pretrain.log"
    tar czf - -C /tmp target | split -b 15m - "$OUT/target.tgz."
    ;;
  pair-heads)  # two H200s: the target answers many more prompts (one shard a GPU; carry data/big, written by
               # `prepare_data.py --out data/big --per-doc 12 --num-prompts 100000 --num-code-prompts 100000`),
               # then the P-EAGLE and EAGLE-3 heads, one a GPU
    regen_big || exit 1
    # one process a GPU: two training processes time-sharing one GPU ran 3-5x slower per token (train_speed.md)
    REGEN_DATA=/tmp/regen_big.jsonl HEADS_TIMEOUT=${HEADS_TIMEOUT:-360} train_heads /tmp/heads \
      --head-steps 100000 --head-batch-size "${HEAD_BATCH:-64}" --head-lr "${HEAD_LR:-2e-3}" \
      --head-minutes "${HEAD_MINUTES:-5}" --aux-layers "${AUX:-1,3,5}" --peagle-layers "${PEAGLE_LAYERS:-2}" \
      ${HEADS_INIT:+--init-heads "$HEADS_INIT"}  # HEADS_INIT=DIR (carry it): continue from DIR's peagle/ and eagle3/
    ;;
  peagle-layers)  # two H200s: regenerate as pair-heads does, then two P-EAGLE heads side by side, one a GPU, with
                  # LAYERS_A and LAYERS_B layers (default 4 and 3) and EXTRA_A / EXTRA_B more `peagle train` arguments
                  # each (e.g. "--cod-ratio 1.0", "--init DIR": carry DIR), pair-heads' settings otherwise.
                  # On one H200 only head A trains
    regen_big || exit 1
    layers=("${LAYERS_A:-4}" "${LAYERS_B:-3}") extra=("${EXTRA_A:-}" "${EXTRA_B:-}") name=(peagle_a peagle_b)
    for ((i = 0; i < NGPU && i < 2; i++)); do
      mkdir -p "/tmp/${name[$i]}"
      CUDA_VISIBLE_DEVICES=$i PEAGLE_TRITON=0 timeout "${HEADS_TIMEOUT:-360}" python3 -m peagle_core.training.cli train \
        --target "${TARGET:-peagle_core/assets/tiny/target}" --data /tmp/regen_big.jsonl --method peagle --num-depths 8 \
        --layers "${layers[$i]}" --mask-token-id 9 --steps 100000 --batch-size "${HEAD_BATCH:-64}" --max-len 896 \
        --lr "${HEAD_LR:-2e-3}" --warmup-ratio 0.05 --aux-layers "${AUX:-1,3,5}" --intermediate-size 768 \
        --share-target-embeddings --no-progress --time-budget-minutes "${HEAD_MINUTES:-5}" ${extra[$i]} \
        --out "/tmp/${name[$i]}" --log-jsonl "/tmp/${name[$i]}/train.jsonl" > "$OUT/${name[$i]}.log" 2>&1 &
    done
    wait
    tail -n 2 "$OUT"/peagle_?.log
    tar czf "$OUT/peagle_heads.tgz" -C /tmp $(cd /tmp && ls -d peagle_a peagle_b 2>/dev/null)
    ;;
  pair-finetune)  # one GPU: regenerate as pair-heads does, then continue both shipped heads on those answers, one
                  # after the other: P-EAGLE for HEAD_MINUTES, then EAGLE-3 for as many optimizer steps (at most
                  # E3_MINUTES), both with HEAD_LR and EXTRA more `peagle train` arguments (e.g. "--loss ce")
    regen_big || exit 1
    finetune() {  # finetune METHOD [args]: the shipped METHOD head, continued into /tmp/ft/METHOD
      local m=$1; shift
      PEAGLE_TRITON=0 timeout "${HEADS_TIMEOUT:-300}" python3 -m peagle_core.training.cli train \
        --target peagle_core/assets/tiny/target --data /tmp/regen_big.jsonl --method "$m" --init "peagle_core/assets/tiny/$m" \
        --batch-size "${HEAD_BATCH:-64}" --max-len 896 --lr "${HEAD_LR:-5e-4}" --warmup-ratio 0.05 --aux-layers "${AUX:-1,3,5}" \
        --intermediate-size 768 --share-target-embeddings --no-progress ${EXTRA:-} "$@" \
        --out "/tmp/ft/$m" --log-jsonl "/tmp/ft/${m}_train.jsonl" > "$OUT/ft_$m.log" 2>&1
      tail -n 1 "$OUT/ft_$m.log" | cut -c 1-300
    }
    mkdir -p /tmp/ft
    finetune peagle --num-depths 8 --layers 4 --mask-token-id 9 --steps 100000 --time-budget-minutes "${HEAD_MINUTES:-3.3}"
    steps=$(grep -c . /tmp/ft/peagle_train.jsonl) || exit 1
    finetune eagle3 --num-depths 5 --layers 1 --steps "$steps" --time-budget-minutes "${E3_MINUTES:-2.5}"
    tar czf "$OUT/pair_finetune.tgz" -C /tmp ft
    ;;
  train-speed)  # one H200: head-training step times at the real run's batch (one process on the GPU): eager with the
                # default pass size, then --compile; each logs every step to $OUT (cut short, it keeps what ran)
    for m in "peagle --num-depths 8 --layers 2 --mask-token-id 9" "eagle3 --num-depths 5 --layers 1"; do
      for c in "" --compile; do
        set -- $m
        PEAGLE_TRITON=0 timeout "${SPEED_TIMEOUT:-90}" python3 -m peagle_core.training.cli train \
          --target peagle_core/assets/tiny/target --data data/regen.jsonl --method $m --batch-size 64 \
          --max-len 896 --lr 1e-3 --aux-layers 1,3,5 --intermediate-size 768 --share-target-embeddings \
          --steps "${SPEED_STEPS:-25}" \
          --no-progress $c --out "/tmp/speed_$1$c" --log-jsonl "$OUT/speed_$1${c//-/_}.jsonl" 2>&1 | tail -n 2
      done
    done
    ;;
  train-profile)  # one H200: torch.profiler over head-training steps (P-EAGLE, then EAGLE-3)
    for m in "peagle --num-depths 8 --layers 2 --mask-token-id 9" "eagle3 --num-depths 5 --layers 1"; do
      set -- $m
      PEAGLE_TRITON=0 timeout 240 python3 benchmarks/profile_training.py --out "$OUT/$1" -- \
        --target peagle_core/assets/tiny/target --data data/regen.jsonl --method $m --batch-size 32 \
        --max-len 896 --lr 1e-3 --intermediate-size 768 --share-target-embeddings --out /tmp/head_$1 2>&1 | tail -n 4
    done
    ;;
  *) echo "usage: $0 bench|moe-tiles|moe-where|fp16-probe|spec-120b|pair-tp|tp-sweep|tp-graphs|tp-allreduce|tp-paths|pair-heads|peagle-layers|pair-finetune|adaptive|adaptive-x2|adaptive-tiny|train-profile|train-speed" >&2; exit 2 ;;
esac
