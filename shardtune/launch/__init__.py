"""Starting the processes: torchrun's command line and agent (torchrun.py), where the topology comes from
(topology.py), and the rendezvous handler that gives every node the same restart count (rendezvous.py)."""
