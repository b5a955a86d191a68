"""TD3 on MuJoCo (CleanRL's td3_continuous_action.py defaults): `python scripts/td3_continuous.py --compile`.

`--env-id`: a gymnasium continuous-control id (`HalfCheetah-v5`, `Hopper-v5`, `Walker2d-v5`, `Pendulum-v1`) or
`torch/Pendulum-v1`. Observations and rewards are raw (no running normalization), as CleanRL's. Checkpoints leave
the replay buffer out unless `--save-buffer` is given (see `--help`).
"""

import tyro

import leanrl
from leanrl.algorithms import td3
from leanrl.offpolicy import main

DEFAULTS = td3.Args(exp_name="td3_continuous", env_id="HalfCheetah-v5")

if __name__ == "__main__":
    with leanrl.clean_exit():
        main(td3, tyro.cli(td3.Args, default=DEFAULTS, description=__doc__), raw=True)
