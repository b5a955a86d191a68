#!/usr/bin/env bash
# A lent GPU's lease (../shared/gpu/README.md) in one command: the CUDA paths of the tests, the built-in sampler's
# decode latency, and the eager / compile / CUDA graphs table. Each phase runs under its own deadline, pytest names
# every test as it ends, and the results folder is archived to $OUT every 10 s, so a phase cut short keeps what it
# measured.   On the device machine:  source .gpu/env.sh && bash benchmarks/gpu_checks.sh
# Budgets in seconds (TESTS_S, GRPO_S, SAMPLER_S, SMOLLM2_S; 0 skips a phase; the table runs until the command's own
# limit), the table's entries (ALGOS, empty for none), and the tests (TESTS, a pytest -k expression). A 15-minute lease
# fits two 10-minute-limit calls at most: the defaults, then TESTS_S=0 GRPO_S=0 SAMPLER_S=0 ALGOS=<the entries left>,
# or SmolLM2's learning curve (SMOLLM2_S, with the wheel benchmarks/gpu_prepare.sh sends in two parts: see there).
# A machine starts bare, so every compile is cold (GRPO's warm-up is the longest of them). The inductor and Triton
# caches come back as $OUT/inductor.tgz (when under 15 MB): put it in .gpu-cache/ (git-ignored) and carry that folder
# with .gpu, and the next lease starts warm (the lent kinds share one compute capability). CACHE=0 starts cold.
set -u
# SAMPLER_S: the GPU decode tables in benchmarks/results/ are older than the sampler's last change when it changes:
# give it 90 s then.
# GRPO_SYNC=1 runs sync GRPO before the async run (the tables so far: benchmarks/results/*/grpo_arith.md).
# STEP_COSTS_S: calls and time per env step (benchmarks/step_costs.py) of the entries issue 60 measures on a GPU.
# ALGOS: the entries whose four-mode GPU table is wanted most, first: issue 60's end-to-end goals (TD3, SAC and
# PPO-Atari in two env buffers under compile + graphs, against the GPU tables in benchmarks/results/), then the
# missing ones, then 8 MuJoCo envs in this process against two buffers in worker processes (with many cores the
# background may pay).
MUJOCO_BUFFERS=ppo_continuous_8envs,ppo_continuous_async_envs
: "${OUT:=/tmp/gpu-checks}" "${CACHE:=1}" "${TESTS_S:=150}" "${GRPO_S:=0}" "${GRPO_SYNC:=0}" "${SAMPLER_S:=0}" \
  "${TESTS:=cuda or graph or compile}" "${SMOLLM2_S:=0}" "${STEP_COSTS_S:=150}" \
  "${ALGOS=td3_continuous,sac_continuous,ppo_atari,ppo_atari_2buffers,ppo_continuous,dqn_atari,$MUJOCO_BUFFERS}" \
  "${SMOLLM2_FLAGS:=--device cuda --dtype bfloat16 --iterations 200 --eval-every 50 --learning-rate 5e-6}"
mkdir -p "$OUT"
# A warm machine keeps /tmp between calls, but not .gpu/ when a call does not carry it (a lease's second call has
# found it gone): the first call leaves there the packages .gpu/env.sh installed and SmolLM2's first part, and a call
# without .gpu/ runs on them (the second call of benchmarks/gpu_prepare.sh).
if [ -d .gpu/site ]; then rm -rf /tmp/gpu-site && cp -r .gpu/site /tmp/gpu-site; fi
for i in 1 2; do
  if [ -f ".gpu-smollm2-$i/part" ]; then mkdir -p /tmp/smollm2 && cp ".gpu-smollm2-$i/part" "/tmp/smollm2/part-$i"; fi
done
if [ -f .gpu-smollm2-1/SHA256SUMS ]; then cp .gpu-smollm2-1/SHA256SUMS /tmp/smollm2/; fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
# The layout an install makes (pyproject's package-dir), for a machine that runs from the working tree.
for d in algorithms envs scripts; do [ -e "leanrl/$d" ] || ln -s "../$d" "leanrl/$d"; done
archive() { tar czf /tmp/results.tgz -C benchmarks results && mv /tmp/results.tgz "$OUT/results.tgz"; }
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache TRITON_CACHE_DIR=/tmp/inductor-cache/triton
if [ "$CACHE" = 1 ] && [ -f .gpu-cache/inductor.tgz ]; then
  tar xzf .gpu-cache/inductor.tgz -C /tmp && echo "inductor cache: $(du -sh /tmp/inductor-cache | cut -f1), carried"
fi
save_cache() {  # after each phase: a call stopped at its limit keeps the compiles of the phases it finished
  [ -d /tmp/inductor-cache ] || return 0
  # Compiled code does not shrink 10x: past 150 MB the archive cannot come back, and gzip would only spend the lease
  # (a whole lease's cache can pass that, compressed). Name its largest parts instead, to know what to leave out.
  if [ "$(du -sb --exclude precompiled_headers /tmp/inductor-cache | cut -f1)" -gt 150000000 ]; then
    echo "inductor cache: $(du -sh /tmp/inductor-cache | cut -f1), too large to bring back; its largest parts:"
    du -sh /tmp/inductor-cache/* /tmp/inductor-cache/triton/* 2>/dev/null | sort -h | tail -n 6
    return 0
  fi
  tar czf /tmp/inductor.tgz -C /tmp --exclude precompiled_headers inductor-cache || return
  if [ "$(stat -c %s /tmp/inductor.tgz)" -lt 15000000 ]; then mv /tmp/inductor.tgz "$OUT/inductor.tgz"
  else echo "inductor cache: $(du -h /tmp/inductor.tgz | cut -f1) compressed, too large to bring back"; fi
}
(while sleep 10; do archive; done) &
keeper=$!

# Every phase writes to its own file, never into a pipe: a command that `timeout` stops can leave children (inductor's
# compile workers) holding the pipe open, and the reader then waits for them forever (a lease lost its table so).
if [ "$TESTS_S" != 0 ]; then  # SIGINT: pytest stops as on Ctrl-C and still prints the failures met so far
  timeout -s INT -k 30 "$TESTS_S" python -m pytest -v -n 8 --timeout 240 -p no:cacheprovider tests -k "$TESTS" \
    > "$OUT/pytest.log" 2>&1
  grep -v PytestBenchmarkWarning "$OUT/pytest.log" | tail -n 40
  save_cache
fi
if [ "$GRPO_S" != 0 ]; then  # GRPO on the GPU, compiled and graphed: async (after sync with GRPO_SYNC=1)
  runs=("--async --max-lag 2")
  if [ "$GRPO_SYNC" = 1 ]; then runs=("" "${runs[@]}"); fi
  for mode in "${runs[@]}"; do
    timeout -k 10 $((GRPO_S / ${#runs[@]})) python scripts/grpo_arith.py --compile --cudagraphs $mode \
      --run-dir /tmp/grpo >> "$OUT/grpo.log" 2>&1
    tail -n 1 "$(ls -td /tmp/grpo/*/ | head -1)metrics.jsonl" >> "$OUT/grpo.log"  # the last logged row
  done
  (cd /tmp/grpo && find . -name metrics.jsonl | tar czf "$OUT/grpo_metrics.tgz" -T -)  # every row, for the planner
  tr '\r' '\n' < "$OUT/grpo.log" | grep -E "^(run|steps|return):"
  save_cache
fi
if [ "$SAMPLER_S" != 0 ]; then
  timeout -k 10 "$SAMPLER_S" python benchmarks/sampler_latency.py --slots 16 64 --models tiny 20m \
    --modes eager compile compile+cudagraphs > "$OUT/sampler.log" 2>&1
  tail -n 30 "$OUT/sampler.log"
  save_cache
fi
if [ "$SMOLLM2_S" != 0 ]; then  # SmolLM2-135M's GRPO learning curve, graphed (eager if that fails), bf16
  start=$SECONDS
  cat /tmp/smollm2/part-1 /tmp/smollm2/part-2 > "/tmp/smollm2/$(cut -d' ' -f3 /tmp/smollm2/SHA256SUMS)" &&
    (cd /tmp/smollm2 && sha256sum -c SHA256SUMS) && export PYTHONPATH=/tmp/smollm2/site:$PYTHONPATH &&
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/smollm2/site /tmp/smollm2/*.whl &&
    { timeout -k 10 "$SMOLLM2_S" python benchmarks/grpo_learning_curve.py --model smollm2-135m --cudagraphs \
        --run-dir /tmp/curve $SMOLLM2_FLAGS > "$OUT/smollm2.log" 2>&1; rc=$?
      left=$((SMOLLM2_S - (SECONDS - start)))
      if [ $rc != 0 ] && [ $rc != 124 ] && [ $left -gt 60 ]; then
        echo "graphed run failed ($rc): eager, $left s" >> "$OUT/smollm2.log"
        timeout -k 10 $left python benchmarks/grpo_learning_curve.py --model smollm2-135m --run-dir /tmp/curve-eager \
          $SMOLLM2_FLAGS >> "$OUT/smollm2.log" 2>&1
      fi; }
  tail -n 30 "$OUT/smollm2.log"
  save_cache
fi
if [ "$STEP_COSTS_S" != 0 ]; then
  timeout -k 10 "$STEP_COSTS_S" python benchmarks/step_costs.py --device cuda \
    --algos td3_continuous,sac_continuous,ppo_atari,ppo_atari_2buffers --modes eager,compile+cudagraphs \
    > "$OUT/step_costs.log" 2>&1
  tail -n 12 "$OUT/step_costs.log"
  save_cache
fi
if [ -n "$ALGOS" ]; then
  python benchmarks/run.py --algos "$ALGOS" --repeats 20 > "$OUT/bench.log" 2>&1
  tail -n 60 "$OUT/bench.log"
fi
kill $keeper; archive; save_cache
