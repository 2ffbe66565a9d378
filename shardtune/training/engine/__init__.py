"""The one engine every objective trains on: worker.py assembles a run, loop.py and step.py train it (accumulation,
the global normaliser, clipping, the step / skip / stop decision), evaluation.py evaluates, checkpoint/ saves and
resumes it, objective.py is what an objective implements."""
