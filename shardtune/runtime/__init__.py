"""The ground floor: the process group and device, the job-wide restart count, preemption, errors, precision,
quiet libraries and atomic file writing. Imports nothing else of shardtune."""
