"""The copy-paste promise: an algorithm file copied alone into an empty directory runs against a plain gymnasium
vector env (through `leanrl.TorchVectorEnv`), or GRPO on a task class of the user's, checkpoints and resumes, with
only leanrl and pip packages importable; and its docstring names exactly the packages it imports."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import gymnasium as gym
import pytest

import leanrl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Run in the copy's directory. Imports of the repository's other folders fail, as they would in another project.
PRELUDE = '''
import importlib.abc, sys
class NotInThisProject(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("algorithms", "envs", "scripts", "benchmarks") or \\
                name.startswith(("leanrl.algorithms", "leanrl.envs")):
            raise ImportError(f"{name} is not part of the copied file's dependencies")
sys.meta_path.insert(0, NotInThisProject())
import gymnasium as gym
from gymnasium.vector import AutoresetMode
import leanrl
def make_envs(env_id, num_envs):
    return leanrl.TorchVectorEnv(gym.make_vec(env_id, num_envs, vectorization_mode="sync",
                                              vector_kwargs={"autoreset_mode": AutoresetMode.SAME_STEP}))
'''

# file name -> what a user writes next to the copy: train, checkpoint at every iteration, then resume to the end.
CASES = {
    "ppo.py": '''
import glob, ppo
args = ppo.Args(env_id="CartPole-v1", num_envs=4, num_steps=32, num_minibatches=2, update_epochs=2, anneal_lr=False,
                total_timesteps=256, checkpoint_every=1, run_dir="runs", progress=False, device="cpu")
first = ppo.train(args, make_envs(args.env_id, args.num_envs))
(ckpt,) = glob.glob("runs/*/checkpoint.pt")
args.total_timesteps, args.resume = 512, ckpt
resumed = ppo.train(args, make_envs(args.env_id, args.num_envs))
assert (first.global_step, resumed.global_step) == (256, 512), (first.global_step, resumed.global_step)
''',
    "td3.py": '''
import glob, td3
args = td3.Args(env_id="Pendulum-v1", num_envs=1, hidden_dim=16, batch_size=16, buffer_size=1000, learning_starts=32,
                total_timesteps=256, checkpoint_every=1, save_buffer=True, run_dir="runs", progress=False,
                device="cpu")
first = td3.train(args, make_envs(args.env_id, args.num_envs))
(ckpt,) = glob.glob("runs/*/checkpoint.pt")
args.total_timesteps, args.resume = 512, ckpt
resumed = td3.train(args, make_envs(args.env_id, args.num_envs))
assert (first.global_step, resumed.global_step) == (256, 512), (first.global_step, resumed.global_step)
''',
    "grpo.py": '''
import collections, glob, grpo
Problem = collections.namedtuple("Problem", "prompt answer demonstration")

class Echo:  # a task of the user's own: repeat the digit
    alphabet = "0123456789=;"
    def problem(self, index, seed=0):
        d = str((index * 7 + seed) % 10)
        return Problem(f"{d}=", d, f"{d};")
    def score(self, problem, completion):
        return float(completion.split(";")[0] == problem.answer)

args = grpo.Args(num_prompts=4, group_size=4, micro_batch=8, max_len=12, max_prompt_len=4, num_slots=8, sft_steps=5,
                 sft_batch=8, total_timesteps=32, checkpoint_every=1, run_dir="runs", progress=False, device="cpu")
grpo.train(args, Echo)
(ckpt,) = glob.glob("runs/*/checkpoint.pt")
args.total_timesteps, args.resume = 64, ckpt
grpo.train(args, Echo)
''',
}


def declared_dependencies(source: str) -> set[str]:
    match = re.search(r"imports only ([^.]*)\.", ast.get_docstring(ast.parse(source)).replace("\n", " "))
    assert match, "the docstring says which packages the file imports ('imports only a, b and c.')"
    return set(re.findall(r"\w+", match[1].replace(" and ", ", "))) - {"and"}


def imported_packages(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names)


@pytest.mark.parametrize("name", CASES)
def test_the_docstring_names_exactly_what_the_file_imports(name):
    source = open(os.path.join(ROOT, "algorithms", name)).read()
    assert imported_packages(source) == declared_dependencies(source)


@pytest.mark.parametrize("name", CASES)
def test_a_copied_file_trains_checkpoints_and_resumes_on_a_plain_gymnasium_env(name, tmp_path):
    shutil.copy(os.path.join(ROOT, "algorithms", name), tmp_path / name)
    (tmp_path / "main.py").write_text(textwrap.dedent(PRELUDE) + textwrap.dedent(CASES[name]))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "main.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (metrics,) = tmp_path.glob("runs/*/metrics.jsonl")
    rows = [json.loads(line) for line in open(metrics)]
    final, returns = (64, "charts/reward_mean") if name == "grpo.py" else (512, "charts/episodic_return")
    assert rows[-1]["global_step"] == final and returns in {k for r in rows for k in r}


def test_the_checkout_is_not_importable_from_the_copy(tmp_path):
    proc = subprocess.run([sys.executable, "-c", "import envs"], cwd=tmp_path, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode != 0 and "No module named 'envs'" in proc.stderr


def test_the_adapter_needs_same_step_autoreset_and_says_how():
    envs = gym.make_vec("CartPole-v1", 2)  # gymnasium's default: NEXT_STEP
    with pytest.raises(ValueError, match="autoreset_mode SAME_STEP.*AutoresetMode.SAME_STEP"):
        leanrl.TorchVectorEnv(envs)
    envs.close()
