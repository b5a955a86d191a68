#!/usr/bin/env bash
# GRPO from a data file with a real verifier, on a CPU: SmolLM2-135M-Instruct on benchmarks/data/easy_sums.jsonl
# (200 GSM8K-style sums; its fixed held-out tenth is never trained on), evaluated before and after by
# `python -m leanrl.llm.evaluate`. Writes benchmarks/results/<machine>/grpo_dataset_smollm2/{before,after}.json and
# the run's metrics. Usage: bash benchmarks/grpo_dataset_smollm2.sh [ITERATIONS]   (about 20 s an iteration on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
iterations=${1:-50}
machine=$(python -c "import sys; sys.path.insert(0, 'benchmarks'); import torch; from measure import machine_info; print(machine_info(torch.device('cpu'))['slug'])")
out=benchmarks/results/$machine/grpo_dataset_smollm2
mkdir -p "$out"
data=(--dataset benchmarks/data/easy_sums.jsonl --prompt-column question --chat-template)
sampling=(--max-len 96 --max-prompt-len 64)
python -m leanrl.llm.evaluate --model-path smollm2-135m "${data[@]}" "${sampling[@]}" --samples 8 --out "$out/before.json"
python scripts/grpo_arith.py --model smollm2-135m "${data[@]}" "${sampling[@]}" --sft-steps 0 --learning-rate 2e-5 \
    --num-prompts 8 --group-size 4 --micro-batch 8 --num-minibatches 1 --update-epochs 1 --num-slots 32 \
    --total-timesteps $((iterations * 32)) --eval-every 10 --eval-prompts 20 --checkpoint-every 10 \
    --run-dir "$out/runs" --exp-name smollm2 --no-progress
run=$(ls -d "$out"/runs/grpo-easy_sums__smollm2__* | tail -1)
cp "$run/metrics.jsonl" "$out/metrics.jsonl"
python -m leanrl.llm.evaluate --model-path "$run/model" "${data[@]}" "${sampling[@]}" --samples 8 --out "$out/after.json"
