"""Online RL (GRPO, TRL's GRPOTrainer): sampling, rewards, advantages and the clipped policy loss."""
