"""The reference: PPO on CartPole written the way people write it today, CleanRL's `ppo.py` loop, eager.

gymnasium's numpy CartPole in a SyncVectorEnv, a torch policy called once per step with a
`torch.distributions.Categorical`, the action sent back with `.cpu().numpy()`, a Python GAE loop, minibatches
shuffled with numpy. Its settings are CleanRL's. benchmarks/cpu_speed.py times it against scripts/ppo_cartpole.py
at the same settings; its arguments are the ones both take.

    python benchmarks/cleanrl_ppo.py --num-envs 4 --total-timesteps 100000
"""

import argparse
import json
import time

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
from torch.distributions.categorical import Categorical


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs):
        super().__init__()
        obs_dim = np.array(envs.single_observation_space.shape).prod()
        self.critic = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                    nn.Tanh(), layer_init(nn.Linear(64, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(), layer_init(nn.Linear(64, 64)),
                                   nn.Tanh(), layer_init(nn.Linear(64, envs.single_action_space.n), std=0.01))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--total-timesteps", type=int, default=100_000)
    p.add_argument("--num-envs", type=int, default=4)
    p.add_argument("--num-steps", type=int, default=128)
    p.add_argument("--num-minibatches", type=int, default=4)
    p.add_argument("--update-epochs", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=2.5e-4)
    p.add_argument("--result", help="write wall time, steps and the returns of finished episodes here as JSON")
    a = p.parse_args()
    gamma, gae_lambda, clip_coef, ent_coef, vf_coef, max_grad_norm = 0.99, 0.95, 0.2, 0.01, 0.5, 0.5
    batch_size = a.num_envs * a.num_steps
    minibatch_size = batch_size // a.num_minibatches
    num_iterations = a.total_timesteps // batch_size

    np.random.seed(a.seed)
    torch.manual_seed(a.seed)
    # SAME_STEP autoreset: the observation after a done is the reset one, as in leanrl's envs (one step per step).
    envs = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1") for _ in range(a.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    agent = Agent(envs)
    optimizer = torch.optim.Adam(agent.parameters(), lr=a.learning_rate, eps=1e-5)

    obs = torch.zeros((a.num_steps, a.num_envs) + envs.single_observation_space.shape)
    actions = torch.zeros((a.num_steps, a.num_envs) + envs.single_action_space.shape)
    logprobs, rewards, dones, values = (torch.zeros((a.num_steps, a.num_envs)) for _ in range(4))

    start_time = time.time()
    next_obs, _ = envs.reset(seed=a.seed)
    next_obs, next_done = torch.Tensor(next_obs), torch.zeros(a.num_envs)
    episode_returns = []
    for iteration in range(1, num_iterations + 1):
        optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / num_iterations) * a.learning_rate
        for step in range(a.num_steps):
            obs[step], dones[step] = next_obs, next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step], logprobs[step] = action, logprob
            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            rewards[step] = torch.tensor(reward).view(-1)
            next_obs, next_done = torch.Tensor(next_obs), torch.Tensor(np.logical_or(terminations, truncations))
            if "episode" in infos:
                episode_returns += infos["episode"]["r"][infos["_episode"]].tolist()

        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = 0
            for t in reversed(range(a.num_steps)):
                if t == a.num_steps - 1:
                    nextnonterminal, nextvalues = 1.0 - next_done, next_value
                else:
                    nextnonterminal, nextvalues = 1.0 - dones[t + 1], values[t + 1]
                delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
                advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
            returns = advantages + values

        b_obs = obs.reshape((-1,) + envs.single_observation_space.shape)
        b_logprobs, b_actions = logprobs.reshape(-1), actions.reshape((-1,) + envs.single_action_space.shape)
        b_advantages, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
        b_inds = np.arange(batch_size)
        for epoch in range(a.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, batch_size, minibatch_size):
                mb_inds = b_inds[start:start + minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                mb_advantages = b_advantages[mb_inds]
                mb_advantages = (mb_advantages - mb_advantages.mean()) / (mb_advantages.std() + 1e-8)
                pg_loss1 = -mb_advantages * ratio
                pg_loss2 = -mb_advantages * torch.clamp(ratio, 1 - clip_coef, 1 + clip_coef)
                pg_loss = torch.max(pg_loss1, pg_loss2).mean()
                newvalue = newvalue.view(-1)
                v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds], -clip_coef, clip_coef)
                v_loss = 0.5 * torch.max(v_loss_unclipped, (v_clipped - b_returns[mb_inds]) ** 2).mean()
                loss = pg_loss - ent_coef * entropy.mean() + v_loss * vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), max_grad_norm)
                optimizer.step()
    wall_s = time.time() - start_time
    envs.close()
    steps = num_iterations * batch_size
    print(f"cleanrl_ppo: {steps} steps in {wall_s:.1f} s ({steps / wall_s:,.0f} SPS), "
          f"mean return of the last 20 episodes {np.mean(episode_returns[-20:]):.1f}")
    if a.result:
        with open(a.result, "w") as f:
            json.dump(dict(steps=steps, train_s=wall_s, episode_returns=episode_returns), f)


if __name__ == "__main__":
    main()
