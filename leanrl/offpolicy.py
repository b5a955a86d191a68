"""What the off-policy algorithms (TD3, SAC, DQN) share: the checks on their common arguments, torchrl's replay
buffer and its place in a checkpoint, the vmapped twin critic and the training loop of TD3 and SAC, and a
periodic deterministic evaluation on an env of its own. Each algorithm's own math stays in its file."""

import sys

import torch
from tensordict import TensorDict
from torch.func import functional_call
from torch.utils._pytree import tree_map
from torchrl.data import LazyTensorStorage, ReplayBuffer

import leanrl


def check_replay_args(args) -> int:
    """Fail on replay settings that cannot work, before any environment is built or anything compiled.
    Returns the number of iterations (vector env steps)."""
    if args.num_envs < 1 or args.total_timesteps < args.num_envs:
        raise ValueError(f"total_timesteps = {args.total_timesteps} is less than one step of num_envs = "
                         f"{args.num_envs} environments")
    if args.batch_size < 1 or args.batch_size > args.buffer_size:
        raise ValueError(f"batch_size = {args.batch_size} must be between 1 and buffer_size = {args.buffer_size}")
    if not 0 <= args.learning_starts < args.total_timesteps:
        raise ValueError(f"learning_starts = {args.learning_starts} must be in [0, total_timesteps = "
                         f"{args.total_timesteps}): otherwise no update would ever run")
    if not 0 < args.tau <= 1:
        raise ValueError(f"tau = {args.tau} must be in (0, 1]")
    if args.eval_every < 0 or args.eval_episodes < 1:
        raise ValueError(f"eval_every = {args.eval_every} must be >= 0 and eval_episodes = {args.eval_episodes} >= 1")
    return args.total_timesteps // args.num_envs


def check_envs(algo: str, args, envs, eval_envs):
    """The env matches the arguments, and an evaluation has an env to run in."""
    if envs.num_envs != args.num_envs:
        raise ValueError(f"envs has {envs.num_envs} environments, args.num_envs = {args.num_envs}")
    if args.eval_every and eval_envs is None:
        raise ValueError(f"{algo}: eval_every > 0 needs an evaluation env (eval_envs)")


def check_box_spaces(algo: str, observation_space, action_space):
    """TD3 and SAC act in a bounded Box and read flat observations."""
    if hasattr(action_space, "n") or not hasattr(action_space, "low"):
        raise ValueError(f"{algo} needs a continuous (Box) action space; got {action_space} "
                         "(use DQN for discrete actions)")
    low, high = torch.as_tensor(action_space.low), torch.as_tensor(action_space.high)
    if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
        raise ValueError(f"{algo} needs a bounded action space; got low={action_space.low}, high={action_space.high}")
    if len(observation_space.shape) != 1:
        raise ValueError(f"{algo} reads flat observations; got shape {observation_space.shape}")


def make_twin_q(qnet):
    """One critic, `q_value(params, obs, action)` -> (batch,), and both in one call, `twin_q(params, obs, action)`
    -> (2, batch), where `params` is the stacked TensorDict of the two networks' weights and `qnet` a weightless
    (meta) copy of the architecture."""

    def q_value(params, obs, action):
        # LeanRL's `with params.to_module(qnet)` here makes torch 2.13's Dynamo fail (an internal error, at the
        # first compiled call, under no_grad); functional_call is the same computation and compiles.
        return functional_call(qnet, dict(params.flatten_keys(".").items()), (obs, action))

    return q_value, torch.vmap(q_value, (0, None, None))


def make_replay_buffer(size: int, batch_size: int, device) -> ReplayBuffer:
    """torchrl's ReplayBuffer with its storage on `device` (allocated for `size` transitions at the first
    `extend`, with the keys, shapes and dtypes of that first batch). `sample()` draws `batch_size`
    transitions uniformly, with replacement, so every batch has the same shape: what a graphed update needs."""
    if batch_size > size:
        raise ValueError(f"batch_size = {batch_size} is larger than buffer_size = {size}")
    return ReplayBuffer(storage=LazyTensorStorage(size, device=device), batch_size=batch_size)


def crossings(before: int, after: int, every: int) -> int:
    """How many multiples of `every` the step count passed going from `before` to `after`."""
    return after // every - before // every


def store(rb: ReplayBuffer, obs, action, out, next_obs):
    """Add one vector step. `next_obs` is the true next observation (from the env's `final_obs`, not the reset
    observation that follows an episode's end), kept with `terminated` apart from `truncated`, so that the
    target bootstraps through a time limit and only stops at a termination."""
    rb.extend(TensorDict(obs=obs, action=action, reward=out["reward"], next_obs=next_obs,
                         terminated=out["terminated"], truncated=out["truncated"], batch_size=[obs.shape[0]]))


def log_step(algo, logger, out, before: int, *outputs):
    """After a vector step from global step `before`: the evaluation when one is due, the finished episodes,
    and at a log boundary the last outputs of the update functions, each given as (names, a stacked tensor, or
    None before the first update)."""
    args = algo.args
    if args.eval_every and crossings(before, algo.global_step, args.eval_every):
        logger.record({"charts/eval_return": evaluate(algo.eval_policy, algo.eval_envs, args.seed + 10_000)})
    logger.record_episodes(out["episode_length"] > 0, out["episode_return"], out["episode_length"])
    if algo.iteration % args.log_every == 0 or algo.iteration == algo.num_iterations:
        logger.record({k: v for names, values in outputs if values is not None
                       for k, v in zip(names, values.unbind())})


class ActorCriticLoop:
    """TD3's and SAC's loop, as CleanRL's: act uniformly at random until `learning_starts`, then with `policy`;
    once the buffer holds `learning_starts` transitions, one critic update per vector step and, every
    `policy_frequency` steps, `actor_updates` actor updates. A subclass builds `policy`, `update_critic`,
    `update_actor`, `envs`, `low`, `high`, `obs_dim` and `action_dim`, then calls `init_loop`; its own math
    lives in those functions, the names of what they return in `critic_metrics` and `actor_metrics`."""

    actor_updates = 1  # per delayed actor step (SAC: policy_frequency, to compensate for the delay)
    critic_metrics: tuple[str, ...]
    actor_metrics: tuple[str, ...]

    def init_loop(self):
        self.rb = make_replay_buffer(self.args.buffer_size, self.args.batch_size, self.device)
        self.obs = None
        self.critic_out = self.actor_out = None  # the last update outputs, read at log boundaries
        self.logged = {}  # the last values written to the log (set by leanrl.run)
        self.global_step = self.iteration = 0
        self.updates = 0  # critic updates by this process (compile and capture happen in the first few)
        self.fill_start = 0  # global step at which the buffer started filling (moves when resumed without it)

    def random_actions(self):
        """Uniform in the action bounds, drawn with torch on the run's device."""
        u = torch.rand(self.args.num_envs, self.action_dim, device=self.device)
        return self.low + (self.high - self.low) * u

    def reset(self, seed):
        self.obs = self.envs.reset(seed=seed)

    def train_iteration(self, logger):
        args = self.args
        with torch.no_grad():
            action = self.random_actions() if self.global_step < args.learning_starts else self.policy(self.obs)
        out = self.envs.step(action)
        store(self.rb, self.obs, action, out, out["final_obs"])
        self.obs = out["next_obs"]
        before, self.global_step = self.global_step, self.global_step + args.num_envs
        self.iteration += 1
        if self.global_step - self.fill_start > args.learning_starts:
            self.updates += 1
            data = self.rb.sample()
            self.critic_out = self.update_critic(data["obs"], data["action"], data["reward"], data["next_obs"],
                                                 data["terminated"])
            if self.iteration % args.policy_frequency == 0:
                for _ in range(self.actor_updates):
                    self.actor_out = self.update_actor(data["obs"])
        if self.updates == 3 * args.policy_frequency + 1:
            # Every function has now been compiled and captured (CUDA graphs capture within the first calls):
            # restart the logger's SPS clock at the end of this iteration, so compile time does not dilute SPS.
            logger.burn_in = logger.iterations + 1
        log_step(self, logger, out, before, (self.critic_metrics, self.critic_out),
                 (self.actor_metrics, self.actor_out))

    def benchmark_calls(self):
        """The accelerated functions with inputs of this run's shapes, for `benchmarks/run.py`."""
        B, device = self.args.batch_size, self.device
        obs, next_obs = torch.randn(B, self.obs_dim, device=device), torch.randn(B, self.obs_dim, device=device)
        actions = self.low + (self.high - self.low) * torch.rand(B, self.action_dim, device=device)
        rewards, terminated = torch.randn(B, device=device), torch.zeros(B, dtype=torch.bool, device=device)
        policy_obs = torch.randn(self.args.num_envs, self.obs_dim, device=device)
        return {"policy": (self.policy, (policy_obs,)),
                "update_critic": (self.update_critic, (obs, actions, rewards, next_obs, terminated)),
                "update_actor": (self.update_actor, (obs,))}


def loop_state(algo) -> dict:
    """What an off-policy run checkpoints besides its networks and optimizers."""
    return dict(envs=algo.envs.state_dict(), obs=algo.obs, global_step=algo.global_step, iteration=algo.iteration,
                fill_start=algo.fill_start, replay_buffer=replay_state_dict(algo.rb, algo.args.save_buffer))


def load_loop_state(algo, state):
    algo.global_step, algo.iteration = state["global_step"], state["iteration"]
    algo.obs = leanrl.restore_envs(algo.envs, state["envs"], state["obs"], seed=algo.args.seed + algo.global_step)
    restored = load_replay_state_dict(algo.rb, state["replay_buffer"])
    # Without its buffer, a resumed run updates again once learning_starts new transitions are stored.
    algo.fill_start = state["fill_start"] if restored else algo.global_step


def replay_state_dict(rb: ReplayBuffer, include: bool):
    """The buffer's contents and write cursor for a checkpoint, or None when `include` is False."""
    return rb.state_dict() if include else None


def load_replay_state_dict(rb: ReplayBuffer, state) -> bool:
    """Restore what `replay_state_dict` saved, onto the buffer's own device (a checkpoint is loaded on CPU).
    Returns False, and says so, when the checkpoint holds no buffer: the caller refills it."""
    if state is None:
        print("leanrl: this checkpoint holds no replay buffer (save one with --save-buffer); the resumed run acts "
              "with the restored policy and updates again once learning_starts new transitions are stored.",
              file=sys.stderr)
        return False
    device = rb.storage.device
    state = tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, state)
    if not rb.storage.initialized:
        # torchrl 0.14 loads into an empty storage without its batch size (sampling then fails): allocate it with
        # one transition of the saved shapes and dtypes first; the load below overwrites it, cursor included.
        stored = TensorDict(state["_storage"]["_storage"], batch_size=[rb.storage.max_size]).unflatten_keys(".")
        rb.extend(stored[:1])
    rb.load_state_dict(state)
    return True


@torch.no_grad()
def evaluate(policy, envs, seed: int) -> torch.Tensor:
    """Mean return of one episode in each of `envs.num_envs` environments, acting with `policy` (obs -> action),
    from a reset with `seed` (the same start states at every evaluation). Reads one flag to the host per step:
    it is meant to run every few thousand training steps, not in the hot loop."""
    obs = envs.reset(seed=seed)
    returns = finished = None
    while finished is None or not bool(finished.all()):
        out = envs.step(policy(obs))
        ended = out["episode_length"] > 0  # a whole episode ended (an Atari life loss is not one)
        if finished is None:
            returns, finished = torch.zeros_like(out["episode_return"]), torch.zeros_like(ended)
        returns = torch.where(ended & ~finished, out["episode_return"], returns)
        finished = finished | ended
        obs = out["next_obs"]
    return returns.mean()
