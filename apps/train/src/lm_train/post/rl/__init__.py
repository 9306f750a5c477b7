"""Reinforcement learning from verifiable rewards (`lm-train rl`): rewards, prompts, rollouts, the GRPO objective."""
