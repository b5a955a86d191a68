#!/usr/bin/env bash
# A lent GPU's lease (../shared/gpu/README.md) in one command: the CUDA paths of the tests, the built-in sampler's
# decode latency, and the eager / compile / CUDA graphs table. Each phase runs under its own deadline, pytest names
# every test as it ends, and the results folder is archived to $OUT every 10 s, so a phase cut short keeps what it
# measured.   On the device machine:  source .gpu/env.sh && bash benchmarks/gpu_checks.sh
# Budgets in seconds (TESTS_S, GRPO_S, SAMPLER_S; 0 skips a phase; the table runs until the command's own limit), the
# table's entries (ALGOS), and the tests (TESTS, a pytest -k expression). A 15-minute lease fits two 10-minute-limit
# calls at most: the defaults, then TESTS_S=0 GRPO_S=0 SAMPLER_S=0 ALGOS=<the entries left>.
set -u
: "${OUT:=/tmp/gpu-checks}" "${TESTS_S:=240}" "${GRPO_S:=120}" "${SAMPLER_S:=90}" "${TESTS:=cuda or graph or compile}" \
  "${ALGOS:=ppo_cartpole,td3_continuous}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv | tee "$OUT/machine.txt"
# The layout an install makes (pyproject's package-dir), for a machine that runs from the working tree.
for d in algorithms envs; do [ -e "leanrl/$d" ] || ln -s "../$d" "leanrl/$d"; done
archive() { tar czf /tmp/results.tgz -C benchmarks results && mv /tmp/results.tgz "$OUT/results.tgz"; }
(while sleep 10; do archive; done) &
keeper=$!

if [ "$TESTS_S" != 0 ]; then
  timeout "$TESTS_S" python -m pytest -v -n 8 --timeout 240 -p no:cacheprovider tests \
    -k "$TESTS" 2>&1 | grep --line-buffered -v PytestBenchmarkWarning | tee "$OUT/pytest.log"
fi
if [ "$GRPO_S" != 0 ]; then  # GRPO on the GPU, sync then async, compiled and graphed; half the budget each
  for mode in "" "--async --max-lag 2"; do
    timeout $((GRPO_S / 2)) python scripts/grpo_arith.py --compile --cudagraphs $mode --run-dir /tmp/grpo \
      2>&1 | tr '\r' '\n' | grep -v "%|" | tee -a "$OUT/grpo.log"
    tail -n 1 "$(ls -td /tmp/grpo/*/ | head -1)metrics.jsonl" | tee -a "$OUT/grpo.log"  # the last logged row
  done
fi
if [ "$SAMPLER_S" != 0 ]; then
  timeout "$SAMPLER_S" python benchmarks/sampler_latency.py --slots 16 64 --models tiny 20m \
    --modes eager compile compile+cudagraphs 2>&1 | tee "$OUT/sampler.log"
fi
python benchmarks/run.py --algos "$ALGOS" --repeats 20 2>&1 \
  | tee "$OUT/bench.log"
kill $keeper; archive
