"""What a training step costs, by formula: FLOPs (the numerator of MFU), the peak FLOP/s it divides by, and the
memory and cross-node traffic of a configuration. Shared by training (the start log, each step's MFU) and the planner
(before any hardware), so that a plan and a run count alike."""
