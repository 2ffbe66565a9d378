"""Preference training (DPO, TRL's DPOTrainer): the pairs' log-probabilities, the losses, the reference."""
