"""Reward modelling: a one-label score head trained with the Bradley-Terry loss (TRL's RewardTrainer)."""
