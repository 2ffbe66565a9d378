"""The objectives: one package each, its Objective subclass in objective.py, named in shardtune.config.objectives
(or by a plug-in's own registration). An objective imports the engine and the floors below, never another
objective."""
