"""GRPO on multi-digit arithmetic with heavy-tailed response lengths (envs/llm_tasks.py).

`python scripts/grpo_arith.py`: a tiny Qwen2 is built for the task's characters, taught the answer format by a
short supervised warm start (cached under runs/warm_start), then trained with GRPO; its solve rate rises within
minutes on a laptop CPU. `--model smollm2-135m` or `--model-path DIR` starts from a pretrained checkpoint instead;
`--async --max-lag K` samples and trains concurrently; add `--deterministic --transport processes` for a bitwise
reproducible async run. `--dataset FILE` trains on a data file of your own instead (docs/grpo_data.md).
"""


import tyro

import leanrl
from leanrl.algorithms import grpo, grpo_async
from leanrl.envs.llm_tasks import task_maker

DEFAULTS = grpo_async.Args(exp_name="grpo_arith", task="arithmetic")

if __name__ == "__main__":
    with leanrl.clean_exit():
        args = tyro.cli(grpo_async.Args, default=DEFAULTS)
        (grpo_async if args.async_ else grpo).train(args, task_maker(args))
