"""One restart count for the whole job, agreed by every node: which start of the worker group this is.

torchrun's agents restart the workers (``--max_restarts N``) and tell them ``TORCHELASTIC_RESTART_COUNT``, but each
agent counts only the restarts it decided itself. When node 1's workers die, node 1's agent counts a restart and
joins the next rendezvous round; node 0's agent then restarts its own healthy workers for the membership change
(``num_nodes_waiting``) without counting anything, unless its workers happened to fail first in a collective
with the dead peer. So node 0's new workers may see 0 and node 1's 1: they disagree on whether to resume from
the latest checkpoint and on the store prefix of their process group (``distributed.attempt_store``), and the
job hangs or trains from scratch on half the nodes, depending on which event came first.

What every node does agree on is the rendezvous round: a worker group only starts after a round completes, and
each round gives its participants a store whose keys are fresh (the dynamic rendezvous prefixes them with the
round). So ``shardtune sft`` (the launcher, which runs torchrun's agent in its own process) wraps torchrun's
rendezvous handler (a backend registered under ``shardtune-<backend>``, torch's documented extension point), and
after each completed round:

1. the agent of group rank 0, and only it, adds 1 to a counter kept in the rendezvous store under this run's id
   (the store outlives the rounds): the value before is the number of worker-group starts before this one;
2. it publishes that number in the round's fresh keys; every other agent reads it there (waiting for it), so a
   stale value of an earlier round can never be read;
3. each agent puts it into its own environment as ``SHARDTUNE_ATTEMPT`` (read by workers with
shardtune.runtime.elastic.worker_group_attempt) just before it starts its workers, which
   inherit it.

Every worker of one group therefore sees the same number, and a larger one than any earlier group: 0 for the
first start, N after N restarts counted anywhere (or membership changes). Exactly one agent increments per
round, so the count does not depend on which node failed or on the order in which the agents noticed.

Not covered: torchrun's ``static`` rendezvous (``--master_addr`` without ``--rdzv_backend``: the same store and
keys for every round, and no re-rendezvous across nodes), and workers started by a plain ``torchrun`` instead of
``shardtune sft``; both fall back to the agent's own ``TORCHELASTIC_RESTART_COUNT``, right on one node.
"""

from __future__ import annotations

import os
import uuid

from shardtune.runtime.elastic import ATTEMPT_ENV

BACKEND_PREFIX = "shardtune-"
_ROUND_KEY = "shardtune/attempt"  # in the round's own (fresh) keys


def agree_on_attempt(round_store, group_rank: int, run_id: str) -> int | None:
    """In each agent, after a rendezvous round: the number of worker-group starts before this round's, the same on
    every node (steps 1 and 2 of the module's docstring). ``round_store`` is the round's store (the rendezvous
    store under the round's prefix); None when it is not a prefixed store (nothing outlives the round then)."""
    counter = getattr(round_store, "underlying_store", None)
    if counter is None:
        return None
    if group_rank == 0:
        attempt = counter.add(f"shardtune/{run_id}/worker_group_starts", 1) - 1
        round_store.set(_ROUND_KEY, str(attempt))
        return attempt
    return int(round_store.get(_ROUND_KEY).decode())  # blocks until group rank 0 has published it


def _handler_class():
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class AttemptCountingHandler(RendezvousHandler):
        """torchrun's own rendezvous handler, unchanged, plus the agreed attempt number after each round."""

        def __init__(self, inner: RendezvousHandler, name: str) -> None:
            self._inner, self._name = inner, name

        def get_backend(self) -> str:
            return self._name  # torch checks that a handler reports the backend name it was registered under

        def next_rendezvous(self):
            info = self._inner.next_rendezvous()
            attempt = agree_on_attempt(info.store, info.rank, self._inner.get_run_id())
            if attempt is not None:
                os.environ[ATTEMPT_ENV] = str(attempt)  # the workers this agent starts next inherit it
            return info

        def is_closed(self) -> bool:
            return self._inner.is_closed()

        def set_closed(self) -> None:
            self._inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return self._inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self._inner.get_run_id()

        def shutdown(self) -> bool:
            return self._inner.shutdown()

        @property
        def use_agent_store(self) -> bool:
            return self._inner.use_agent_store

        def __getattr__(self, name: str):
            if name == "_inner":
                raise AttributeError(name)
            return getattr(self._inner, name)

    return AttemptCountingHandler


_creators: dict[str, object] = {}


def counting_backend(backend: str) -> str:
    """Register ``shardtune-<backend>`` (once per process): torchrun's ``backend`` handler, wrapped."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    name = BACKEND_PREFIX + backend
    if name not in _creators:
        handler_class = _handler_class()

        def create(params: RendezvousParameters):
            inner = RendezvousParameters(
                backend,
                params.endpoint,
                params.run_id,
                params.min_nodes,
                params.max_nodes,
                params.local_addr,
                **params.config,
            )
            if backend == "c10d" and params.max_nodes == 1:  # nobody else to meet: loopback only
                from shardtune.launch.rendezvous_loopback import loopback_c10d_handler

                return handler_class(loopback_c10d_handler(inner), name)
            return handler_class(rendezvous_handler_registry.create_handler(inner), name)

        rendezvous_handler_registry.register(name, create)
        _creators[name] = create
    return name


def count_attempts_across_nodes(args) -> None:
    """Make torch.distributed.run's parsed ``args`` use the counting handler (a dynamic rendezvous only).

    ``--standalone`` is turned into what torch.distributed.run makes of it (c10d on localhost, a random port and
    run id), so that one node counts the same way; ``static`` is left as it is (see the module's docstring).
    """
    if args.standalone:
        args.standalone = False
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.rdzv_backend != "static" and not args.rdzv_backend.startswith(BACKEND_PREFIX):
        args.rdzv_backend = counting_backend(args.rdzv_backend)
