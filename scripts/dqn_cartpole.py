"""DQN on CartPole (CleanRL's dqn.py defaults): `python scripts/dqn_cartpole.py --compile`.

The default env is `torch/CartPole-v1`: gymnasium's CartPole dynamics (checked step for step in
tests/test_envs.py) simulated in torch on the run's device, so the whole loop runs without a host sync.
`--env-id CartPole-v1` runs gymnasium's own, as CleanRL does.
"""

import tyro

import leanrl
from leanrl.algorithms import dqn
from leanrl.offpolicy import main

DEFAULTS = dqn.Args(exp_name="dqn_cartpole", env_id="torch/CartPole-v1", total_timesteps=500_000)

if __name__ == "__main__":
    with leanrl.clean_exit():
        main(dqn, tyro.cli(dqn.Args, default=DEFAULTS, description=__doc__))
