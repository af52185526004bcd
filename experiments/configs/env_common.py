"""What every environment experiment sets on top of grpo_arithmetic's keys.

An environment run (`config.env`) draws its tasks each step and scores
episodes by their return; the data, prompt and reward keys of single-turn runs
are not used (experiments/common.py refuses the ones that would change a
result).
"""

import ml_collections

# What the `:tiny` smoke configs add to each training episode's return: a penalty on the
# length of the agent's replies (characters beyond 4, 0.05 per 4). The tiny random model
# never succeeds at a task, so on the return alone every group's rewards are equal and
# the update has no gradient: a smoke run could not tell a working update from a broken
# one. Its replies' lengths vary, and so do these rewards.
TINY_REPLY_REWARDS = {"length_penalty": {"weight": 1.0, "budget": 4, "coef": 0.05}}


def set_env(c: ml_collections.ConfigDict, variant: str | None, *, env: str, options: dict,
            tiny_options: dict, max_turns: int, tiny_max_turns: int, max_new_tokens: int,
            tiny_max_new_tokens: int) -> ml_collections.ConfigDict:
  """Sets the environment (a registered name and its options), the episode's shape and the
  batch: 4 tasks x 8 episodes per step, 64 held-out tasks; `:tiny` halves the tasks."""
  tiny = variant == "tiny"
  c.env = env
  c.env_kwargs = ml_collections.ConfigDict(tiny_options if tiny else options)
  c.max_turns = tiny_max_turns if tiny else max_turns
  c.max_new_tokens = tiny_max_new_tokens if tiny else max_new_tokens  # per turn
  c.env_step_timeout_s = 10.0  # host environments: a slower step ends its episode (counted)
  c.env_obs_tokens = 64  # host environments: a longer answer is cut (counted)
  c.env_answer_tokens = 32  # host environments, turn_credit "igpo": the gold answer's cap
  # Registered rewards of the agent's replies (concatenated), added to each training
  # episode's return (GRPO's episode reward, not the turn rewards): {name: weight} or
  # {name: {weight, **options}}, as config.rewards. Empty: the return alone.
  c.env_reply_rewards = ml_collections.ConfigDict(TINY_REPLY_REWARDS if tiny else {})
  c.task = ""
  c.prompts_per_step = 2 if tiny else 4
  c.group_size = 8
  c.eval_size = 8 if tiny else 64
  c.eval_batch_size = 8 if tiny else 32
  c.temperature = 1.0
  # How an episode's advantage reaches its turns (registry kind "turn_credit",
  # jaxrl_agents/objectives/credit/turn_credits.py):
  # "episode" (every token its episode's), "turn" (IGPO: standardized turn rewards'
  # returns-to-go), "gigpo" (plus step_weight x the advantage among turns from the same
  # state), "igpo" ("turn" over information-gain rewards: the rise in the policy's own
  # probability of the environment's gold answer across each turn). gamma discounts turn
  # returns and the shaping.
  c.turn_credit = ml_collections.ConfigDict(dict(name="episode", gamma=1.0, step_weight=1.0))
  # Add gamma phi(s') - phi(s) to each turn's reward (the environment's potential).
  c.potential_shaping = False
  # The update runs the model over every column of the history (K x (reply + answer)),
  # with vocabulary logits at the replies' only: four minibatches keep SmolLM2's update
  # within a few GB (one batch of 32 calculator episodes asked for 31 GB when every
  # column had logits).
  c.minibatches = 1 if tiny else 4
  return c
