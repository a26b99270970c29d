"""The memory-aware request router for the engine deployment.

Ray Serve runs one router per deployment handle, in the process that holds the handle: here, the ingress replica.
So the router and the ingress's admission gate share one `CapacityBoard` (a per-process registry, keyed by the
engine deployment): the router feeds it the replicas' `record_routing_stats` reports as Serve delivers them, the
gate places each request on the replica it fits best and reserves it there, and the router sends the request to
that replica. Calls that carry no placement (model info, health probes) go to any replica.

Serve pickles this module by value into the process that runs the router, so it holds no state of its own: the
registry of boards lives in `serve_app.admission`, which is imported by reference.
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app.admission import board_for


def request_id_of(pending_request: Optional[PendingRequest]) -> str | None:
    """The request id the ingress put in the first argument of `EngineReplica.generate`, if any."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first.get("request_id") if isinstance(first, dict) else None


class MemoryAwareRouter(RequestRouter):
    """Sends each placed request to the replica the admission gate reserved it on (by prefix affinity, else by
    load; see serve_app.admission); if that replica is gone, re-places it the same way among the live ones."""

    def initialize_state(self, **kwargs):
        self._board = board_for(self._deployment_id.app_name, self._deployment_id.name)

    def update_replicas(self, replicas: List[RunningReplica]):
        super().update_replicas(replicas)
        self._board.update({r.replica_id.unique_id: r.routing_stats or {} for r in replicas})

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        request_id = request_id_of(pending_request)
        if request_id is None:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        placed = self._board.placement(request_id)
        if placed in by_id:
            return [[by_id[placed]]]
        return self._replace(request_id, pending_request, by_id)

    def _replace(self, request_id: str, pending_request: PendingRequest,
                 by_id: dict[str, RunningReplica]) -> List[List[RunningReplica]]:
        args = pending_request.args[0]
        self._board.release(request_id)
        placed = self._board.place(request_id, args["gpu_bytes"], args["host_bytes"], among=set(by_id),
                                   keys=args["affinity"])
        # Nothing fits any more (a replica died under us): let the replica refuse it rather than hang here.
        return [[by_id[placed]]] if placed in by_id else [list(by_id.values())]
