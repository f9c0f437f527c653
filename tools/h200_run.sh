#!/usr/bin/env bash
# One device-machine session: GPU suite through tox, then the benchmarks.
# Usage (on the GPU machine, from the repo root): bash tools/h200_run.sh OUTDIR [steps]
# steps: tox toxnewest gputests enginepath bm6 bm6traces bm7 e2etraces bm2 bandwidth bandwidth16 bandwidth1lane bandwidth2gpu
# bandwidth2proc abcompare abengine abbm6 abtraces (OLD_TREE=folder)
# overlap disk e2edisk e2e e2e2gpu soak toxsoak sanitizer toxcsan csandirect (default: tox bm2 bandwidth overlap). Wheels for tox are
# taken from .whl/ when present (the machine has no network).
set -uo pipefail
final=${1:?output folder}
shift
# Everything goes under $out and is packed into one archive at the end (the
# device tool brings back at most 8 files).
out="$final/raw"
steps=${*:-tox bm2 bandwidth overlap}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && ! python3 -c "import tox" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
# .whl/tf: the newest supported transformers and what it needs beyond the machine's own
# packages. `toxnewest` installs them into tox's gpu-newest env; HF_NEWEST=1 puts them
# (in /tmp/site_tf) ahead of the machine's transformers for every other step.
if [ -n "${HF_NEWEST:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_tf \
    .whl/tf/*.whl || exit 1
  export PYTHONPATH="/tmp/site_tf${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import torch, Cython, sys, transformers; print(sys.version.split()[0], torch.__version__, Cython.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
# Steps other than tox use the system python3 with an in-place build.
# (Not when every step goes through tox, which builds in its own env.)
if [ -n "$(echo " $steps " | sed -E 's/ (tox|toxnewest|toxsoak|toxcsan)( (tox|toxnewest|toxsoak|toxcsan))*//g; s/ //g')" ]; then
  ls prefetch/_engine.cpython-*.so >/dev/null 2>&1 || python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
for step in $steps; do
  case $step in
    tox|toxnewest)
      # The whole suite in two tox runs of one env: the tests not marked gpu over
      # XDIST (default 8) pytest-xdist workers, then the gpu-marked ones alone in
      # one process (they compare the device's free memory and time streams).
      # toxnewest: tox -e gpu-newest, the newest supported transformers (.whl/tf).
      env=gpu; log=tox_gpu
      [ "$step" = toxnewest ] && env=gpu-newest && log=tox_gpu_newest
      for part in "not gpu" gpu; do
        xdist=(); [ "$part" = "not gpu" ] && xdist=(-n "${XDIST:-8}")
        echo "== tox -e $env -m \"$part\"" | tee -a "$out/$log.log"
        PREFETCH_HF_WHEELS="$PWD/.whl/tf" python3 -m tox -e "$env" -- -ra -q --durations=10 "${xdist[@]}" \
          -m "$part" tests 2>&1 | tee -a "$out/$log.log" | tail -25
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
      done ;;
    bm2)
      bm2_args="--warmup ${BM2_WARMUP:-20} --iterations ${BM2_ITERS:-200}"
      python3 bench/issuance.py --backend host $bm2_args --json "$out/bm2_host.json" 2>&1 | tee "$out/bm2_host.txt"
      python3 bench/issuance.py --backend cuda $bm2_args --json "$out/bm2_cuda.json" 2>&1 | tee "$out/bm2_cuda.txt" ;;
    bandwidth)
      python3 bench/bandwidth.py --json "$out/bandwidth.json" 2>&1 | tee "$out/bandwidth.txt" ;;
    bandwidth16)
      python3 bench/bandwidth.py --chunk-mib 16 --json "$out/bandwidth_chunk16.json" 2>&1 | tee "$out/bandwidth_chunk16.txt" ;;
    bandwidth2gpu)
      python3 bench/bandwidth.py --devices 2 --json "$out/bandwidth_2gpu.json" 2>&1 | tee "$out/bandwidth_2gpu.txt" ;;
    bandwidth2proc)
      # One process per GPU at once, as expert parallel runs (a diagnostic:
      # the two start together and run the same phases, not in lockstep).
      for d in 0 1; do
        CUDA_VISIBLE_DEVICES=$d python3 bench/bandwidth.py --sizes-mib 9.4 64 --json "$out/bandwidth_proc$d.json" \
          >"$out/bandwidth_proc$d.txt" 2>&1 &
      done
      wait
      cat "$out"/bandwidth_proc*.txt ;;
    abcompare)
      # BM2 and bandwidth of an older tree (OLD_TREE, a carried folder, built
      # here) and of this one, alternating in one run: same-run ratios.
      (cd "${OLD_TREE:?}" && python3 setup.py -q build_ext --inplace >"$out/build_old.log" 2>&1) || status=1
      for i in 1 2; do
        for side in new old; do
          dir=$PWD
          [ "$side" = old ] && dir=$(cd "$OLD_TREE" && pwd)
          (cd "$dir" && PYTHONPATH="$dir" python3 bench/issuance.py --backend cuda --warmup 20 --iterations 200 \
            --json "$out/ab_bm2_${side}_$i.json" >"$out/ab_bm2_${side}_$i.txt" 2>&1)
          (cd "$dir" && PYTHONPATH="$dir" python3 bench/bandwidth.py --sizes-mib 9.4 64 \
            --json "$out/ab_bw_${side}_$i.json" >"$out/ab_bw_${side}_$i.txt" 2>&1)
          echo "$side $i: $(grep -E '^(batched|cpp)' "$out/ab_bm2_${side}_$i.txt" | tr -s ' ' | tr '\n' ';')"
          grep -E '^ +[0-9]' "$out/ab_bw_${side}_$i.txt"
        done
      done ;;
    bandwidth1lane)
      python3 bench/bandwidth.py --lanes 1 --json "$out/bandwidth_1lane.json" 2>&1 | tee "$out/bandwidth_1lane.txt" ;;
    e2e)
      python3 bench/e2e.py --warmup "${E2E_WARMUP:-2}" --steps "${E2E_STEPS:-8}" --train 2 \
        --budget-s "${E2E_BUDGET_S:-300}" --json "$out/e2e.json" --plots "$out/plots" \
        --trace-out "$out/traces" ${E2E_ARGS:-} 2>"$out/e2e.log" | tee "$out/e2e.txt" || status=1 ;;
    e2e2gpu)
      # BM5 with the layers split over two GPUs (E2E2_ARGS: a smaller grid).
      python3 bench/e2e.py --devices 2 --warmup "${E2E_WARMUP:-2}" --steps "${E2E_STEPS:-8}" --train 2 \
        --budget-s "${E2E2_BUDGET_S:-150}" --json "$out/e2e_2gpu.json" --plots "$out/plots_2gpu" \
        ${E2E2_ARGS:-} 2>"$out/e2e_2gpu.log" | tee "$out/e2e_2gpu.txt" || status=1 ;;
    toxsoak)
      python3 -m tox -e gpu-soak -- --minutes "${SOAK_MINUTES:-3}" --json "$out/soak.json" 2>&1 | tee "$out/soak.txt" | tail -30 || status=1 ;;
    toxcsan)
      # The whole GPU suite under memcheck, synccheck and initcheck, as tox runs it.
      timeout "${CSAN_TIMEOUT:-540}" python3 -m tox -e gpu-csan 2>&1 | tee "$out/csan.txt" | grep -E "ERROR SUMMARY|passed|failed|error|gpu-csan" | tail -30
      echo "exit ${PIPESTATUS[0]}" | tee -a "$out/csan.txt" ;;
    csandirect)
      # gpu-csan's three runs as tox.ini has them, on this in-place build (no
      # second build of the package: tox builds one per env).
      for tool in memcheck synccheck initcheck; do
        select=(tests/test_cuda.py tests/test_integration.py tests/test_checkpoint_experts.py -m gpu)
        [ "$tool" = initcheck ] && select+=(-k "not bf16")
        echo "== compute-sanitizer --tool $tool" | tee -a "$out/csan.txt"
        PYTHONFAULTHANDLER=1 PREFETCH_TEST_UNDER_TOOL=1 PREFETCH_TEST_SPIN_CYCLES=4000000000 timeout "${CSAN_TIMEOUT:-240}" \
          compute-sanitizer --tool $tool --error-exitcode 99 --target-processes all \
          python3 -m pytest -q -p no:cacheprovider "${select[@]}" 2>&1 | tail -6 | tee -a "$out/csan.txt"
        echo "exit ${PIPESTATUS[0]}" | tee -a "$out/csan.txt"
      done ;;
    soak)
      python3 tools/soak.py --minutes "${SOAK_MINUTES:-3}" --json "$out/soak.json" 2>"$out/soak.log" | tee "$out/soak.txt" || status=1 ;;
    sanitizer)
      # compute-sanitizer over the GPU tests; probe first (not every runtime allows it).
      if compute-sanitizer --version >/dev/null 2>&1; then
        for tool in ${CSAN_TOOLS:-memcheck synccheck initcheck}; do
          echo "== compute-sanitizer --tool $tool"
          PREFETCH_TEST_UNDER_TOOL=1 PREFETCH_TEST_SPIN_CYCLES=${CSAN_SPIN:-4000000000} timeout "${CSAN_TIMEOUT:-170}" compute-sanitizer --tool $tool --error-exitcode 99 --target-processes all \
            python3 -m pytest -q -x -p no:cacheprovider tests/test_cuda.py -k "${CSAN_TESTS:-not leak}" 2>&1 | tail -15 | tee "$out/csan_$tool.txt"
          echo "exit ${PIPESTATUS[0]}" | tee -a "$out/csan_$tool.txt"
        done
      else
        echo "compute-sanitizer not available" | tee "$out/csan.txt"
      fi ;;
    gputests)
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_integration.py tests/test_cuda.py 2>&1 \
        | tee "$out/gputests.txt" | tail -15 || status=1 ;;
    abengine)
      # bench/engine_path.py of this tree over the engine of an older one
      # (OLD_TREE, built here) and of this one, alternating: same-run ratios.
      (cd "${OLD_TREE:?}" && python3 setup.py -q build_ext --inplace >"$out/build_old.log" 2>&1) || status=1
      old_dir=$(cd "$OLD_TREE" && pwd)
      for i in 1 2 3; do
        for side in new old; do
          dir=$PWD
          [ "$side" = old ] && dir=$old_dir
          echo "== $side $i"
          PYTHONPATH="$dir" python3 bench/engine_path.py --backend cuda --iterations ${ENGINE_ITERS:-2000} \
            --json "$out/abengine_${side}_$i.json" 2>&1 | tail -8
        done
      done ;;
    abbm6)
      # BM6 (BM6_ARGS) of an older tree (OLD_TREE, built here) and of this one, alternating
      # (AB_ROUNDS, default 2): same-run ratios of a Python-side change on the path users run.
      (cd "${OLD_TREE:?}" && python3 setup.py -q build_ext --inplace >"$out/build_old.log" 2>&1) || status=1
      old_dir=$(cd "$OLD_TREE" && pwd)
      for i in $(seq 1 "${AB_ROUNDS:-2}"); do
        for side in new old; do
          dir=$PWD
          [ "$side" = old ] && dir=$old_dir
          echo "== $side $i"
          (cd "$dir" && PYTHONPATH="$dir" python3 bench/generate.py ${BM6_ARGS:-} --budget-s "${BM6_BUDGET_S:-480}" \
            --json "$out/ab_bm6_${side}_$i.json" 2>"$out/ab_bm6_${side}_$i.log" | tee "$out/ab_bm6_${side}_$i.txt") \
            || status=1
        done
      done ;;
    enginepath)
      python3 bench/engine_path.py --backend cuda --json "$out/engine_path.json" 2>&1 | tee "$out/engine_path.txt" ;;
    bm6)
      # BM6_ARGS picks models, batches, shares (one model per device call fits its limit);
      # BM6_PROFILE=1 adds --profile (a profiled generate per row, bench/generate_profile.py).
      python3 bench/generate.py ${BM6_ARGS:-} ${BM6_PROFILE:+--profile "$out/bm6_profile${BM6_TAG:-}"} \
        --budget-s "${BM6_BUDGET_S:-480}" --json "$out/bm6${BM6_TAG:-}.json" \
        --plot "$out/bm6${BM6_TAG:-}.png" 2>"$out/bm6${BM6_TAG:-}.log" | tee "$out/bm6${BM6_TAG:-}.txt" || status=1 ;;
    bm6traces)
      # BM6 with the routing forced from each real trace of ../shared/traces (copied to traces/;
      # TRACES picks them): BM6_ARGS and BM6_PROFILE as for bm6, BM6_BUDGET_S per trace.
      for t in ${TRACES:-traces/*.json}; do
        name=$(basename "$t" .json)
        python3 bench/generate.py --trace-in "$t" ${BM6_ARGS:-} ${BM6_PROFILE:+--profile "$out/bm6_profile_$name"} \
          --budget-s "${BM6_BUDGET_S:-300}" \
          --json "$out/bm6_$name.json" --plot "$out/bm6_$name.png" 2>"$out/bm6_$name.log" \
          | tee "$out/bm6_$name.txt" || status=1
        tar -czf "$final/results.tgz" -C "$final" raw  # each trace's results kept if the next one is cut
      done ;;
    bm7)
      # Expert parallel over the GPUs of this machine (BM7_ARGS: models, batches, shares).
      timeout "${BM7_TIMEOUT:-300}" torchrun --standalone --nproc-per-node "${BM7_RANKS:-2}" bench/ep_generate.py \
        ${BM7_ARGS:-} --json "$out/bm7${BM7_TAG:-}.json" 2>"$out/bm7${BM7_TAG:-}.log" | tee "$out/bm7${BM7_TAG:-}.txt" || status=1 ;;
    e2etraces)
      # BM5 replaying the real routing traces of ../shared/traces (copied to traces/ for the run);
      # TRACES_PROFILE=1 adds --profile (GPU and host split of a few more steps per policy);
      # TRACES_POLICIES replaces the policies, TRACES_ARGS adds arguments (--oracle-distance 4),
      # TRACES_AB_ROWS="ROW_A ROW_B" pairs two of the policies round by round at the end (bench/diagnostics/ab_pairs.py --rows).
      for t in ${TRACES:-traces/*.json}; do
        python3 bench/e2e.py --trace-in "$t" --trace-from 1 --models "$(basename "$t" .json)" --shares ${TRACES_SHARES:-0.25} --batches 1 --warmup 2 --steps "${E2E_STEPS:-24}" \
          --policies ${TRACES_POLICIES:-all-resident on-demand next-layer-gate oracle torch-by-hand} --budget-s "${TRACES_BUDGET_S:-150}" ${TRACES_ARGS:-} \
          --repeats "${TRACES_REPEATS:-1}" ${TRACES_PROFILE:+--profile "$out/prof_$(basename "$t" .json)" --profile-steps "${TRACES_PROFILE_STEPS:-4}"} \
          --json "$out/e2e_$(basename "$t" .json).json" 2>"$out/e2e_$(basename "$t" .json).log" \
          | tee "$out/e2e_$(basename "$t" .json).txt" || status=1
        # The Chrome traces are too large to bring back; the op tables (.txt) and the rows' "profile" stay.
        rm -f "$out/prof_$(basename "$t" .json)"/*.json
      done
      # TRACES_AB_ROWS="ROW_A ROW_B": the two rows round by round, each against its round's floor.
      if [ -n "${TRACES_AB_ROWS:-}" ]; then
        python3 bench/diagnostics/ab_pairs.py "$out" --rows $TRACES_AB_ROWS --json "$out/ab_rows.json" 2>&1 | tee "$out/ab_rows.txt"
      fi ;;
    abtraces)
      # BM5 trace replays (TRACES, TRACES_POLICIES, E2E_STEPS, TRACES_BUDGET_S) of an older tree (OLD_TREE,
      # built here) and of this one, alternating (AB_ROUNDS, default 2): same-run figures of a change. This
      # tree goes first in odd rounds, the older one in even rounds, so neither side always follows the
      # other (runs 140-142 ran one order per run and could not tell a 10 % difference from the host's drift).
      (cd "${OLD_TREE:?}" && python3 setup.py -q build_ext --inplace >"$out/build_old.log" 2>&1) || status=1
      old_dir=$(cd "$OLD_TREE" && pwd)
      ab_policies=${TRACES_POLICIES:-all-resident on-demand oracle torch-by-hand}
      for i in $(seq 1 "${AB_ROUNDS:-2}"); do
        for t in ${TRACES:-traces/*.json}; do
          name=$(basename "$t" .json)
          sides="new old"
          [ $((i % 2)) -eq 0 ] && sides="old new"
          for side in $sides; do
            dir=$PWD
            [ "$side" = old ] && dir=$old_dir
            echo "== $side $i $name"
            (cd "$dir" && PYTHONPATH="$dir" python3 bench/e2e.py --trace-in "$OLDPWD/$t" --trace-from 1 --models "$name" \
              --shares 0.25 --batches 1 --warmup 2 --steps "${E2E_STEPS:-16}" \
              --policies $ab_policies --budget-s "${TRACES_BUDGET_S:-150}" \
              --json "$out/ab_${name}_${side}_$i.json" 2>"$out/ab_${name}_${side}_$i.log" \
              | tee "$out/ab_${name}_${side}_$i.txt") || status=1
          done
        done
      done
      # Round by round, each tree against the floor of its own moment (bench/diagnostics/ab_pairs.py).
      for p in $ab_policies; do
        [ "$p" = all-resident ] && continue
        python3 bench/diagnostics/ab_pairs.py "$out" --policy "$p" 2>&1 | tee -a "$out/ab_pairs.txt" || status=1
      done ;;
    e2edisk)
      # #15's BM5 cell: on-demand with the experts in host memory against the same read from disk
      # through the engine's host tier of half the expert bytes (DISK_TRACE: a trace of traces/).
      # DISK_WARMUP=128 (the gemma-4 trace's length after its first step) warms every cache on the
      # whole trace first; the measured steps then replay its first steps (BM5 forces step i % length).
      t=${DISK_TRACE:-traces/gemma4-26b-a4b.json}
      python3 bench/e2e.py --trace-in "$t" --trace-from 1 --models "$(basename "$t" .json)" --shares 0.25 --batches 1 \
        --warmup "${DISK_WARMUP:-2}" --steps "${E2E_STEPS:-24}" --policies all-resident on-demand on-demand-disk --repeats "${TRACES_REPEATS:-1}" \
        --disk-dir "${DISK_DIR:-$PWD}" --budget-s "${TRACES_BUDGET_S:-150}" --json "$out/e2e_disk.json" \
        2>"$out/e2e_disk.log" | tee "$out/e2e_disk.txt" || status=1 ;;
    overlap)
      python3 bench/overlap.py --json "$out/overlap.json" 2>&1 | tee "$out/overlap.txt" ;;
    disk)
      # DiskReader against a plain O_DIRECT loop on this machine's disk, and into the GPU (DISK_ARGS: sizes).
      python3 bench/disk.py --dir "${DISK_DIR:-$PWD}" ${DISK_ARGS:-} --json "$out/disk.json" 2>&1 | tee "$out/disk.txt" ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
  # Pack after every step: a run cut short still brings back what it made.
  tar -czf "$final/results.tgz" -C "$final" raw
done
rm -rf "$out"
exit $status
