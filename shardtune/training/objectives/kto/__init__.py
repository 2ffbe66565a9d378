"""Preference training from unpaired completions (KTO, TRL's KTOTrainer): the losses, the KL rows, the objective."""
