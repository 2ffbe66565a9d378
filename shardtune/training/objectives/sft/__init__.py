"""Supervised fine-tuning: next-token loss on the labelled tokens (TRL's SFTTrainer)."""
