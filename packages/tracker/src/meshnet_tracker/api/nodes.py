"""Tracker routes for nodes: register, heartbeat, leave, and route lookup."""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request, Response

from meshnet_common.errors import InvalidRequest, MeshnetError, NotFound, Unauthorized
from meshnet_common.memory import ModelCosts
from meshnet_common.precision import Precision, compute_dtype_name
from meshnet_common.protocol import (
    H_NODE_SECRET,
    H_OPERATOR_TOKEN,
    AssignRequest,
    AssignResponse,
    Heartbeat,
    HeartbeatResponse,
    NodeAnnouncement,
    NodeState,
    RegisterResponse,
    RouteHop,
    RouteResponse,
    ShardSpec,
    Verdict,
    VerdictResponse,
)
from meshnet_common.trust.evidence import check_evidence
from meshnet_common.web.auth import same_secret
from meshnet_common.web.hosts import server_url, source_of
from meshnet_common.web.http import parse_model
from meshnet_tracker.api.admission import confirm_reachable, reachable_url
from meshnet_tracker.placement import NodeRequest, Placement
from meshnet_tracker.registry import NodeRecord
from meshnet_tracker.state import TrackerState


class NoLeader(MeshnetError):
    """A follower tracker cannot reach the leader that places nodes (503: ask again)."""

    status = 503
    error_type = "service_unavailable"


def _state(request: Request) -> TrackerState:
    return request.app.state.tracker


def _proof(request: Request) -> str | None:
    return request.headers.get(H_NODE_SECRET)


def _operator(request: Request) -> bool:
    """Whether the caller holds the operator credential (docs/adr/0032)."""
    token = _state(request).settings.operator_token
    return same_secret(token, request.headers.get(H_OPERATOR_TOKEN))


def _need_operator(request: Request, action: str) -> None:
    if not _operator(request):
        hint = "" if _state(request).settings.operator_token else " (start it with one)"
        raise Unauthorized(
            f"{action} needs the tracker's --operator-token{hint}", code="operator_only"
        )


def _need_node(request: Request, node_id: str, what: str) -> None:
    if not _state(request).registry.authentic(node_id, _proof(request)):
        raise Unauthorized(
            f"{what} needs the node secret of {node_id!r} (x-meshnet-node-secret)",
            code="node_unauthenticated",
        )


def nodes_router() -> APIRouter:
    router = APIRouter()

    @router.post("/v1/nodes/register")
    async def register(request: Request) -> RegisterResponse:
        state = _state(request)
        announcement = await parse_model(request, NodeAnnouncement, limit=64 * 1024)
        try:
            announcement.shard.layers.check_within(announcement.num_layers)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="shard") from exc
        _check_layers(state, announcement)
        state.registry.claim(announcement.node_id, _proof(request))  # before any call-back
        source = request.client.host if request.client else None
        serving = announcement.state == NodeState.SERVING
        state.registry.admit_source(
            source_of(source), announcement.node_id, announcement.shard.model_id if serving else None,
            max_nodes=state.settings.max_nodes_per_source,
            max_models=state.settings.max_models_per_source,
        )  # fmt: skip
        tls = state.settings.tls_cert is not None  # then https:// nodes only (docs/adr/0032)
        url = reachable_url(announcement.url, announcement.url_explicit, source, https_only=tls)
        if serving and state.settings.verify_nodes:
            await confirm_reachable(
                state.callback, url, announcement.node_id, explicit=announcement.url_explicit
            )
        if url != announcement.url:
            announcement = announcement.model_copy(update={"url": url})
        _check_layers(state, announcement)  # another node may have named it meanwhile
        # Without --verify-nodes the operator takes serving registrations as they come.
        record = state.registry.register(
            announcement, proof=_proof(request), called_back=serving, source=source_of(source)
        )
        if serving:
            state.balancer.registered(announcement.node_id)
        await state.sync()  # the other trackers know it (and its secret) from here on
        return RegisterResponse(
            node_id=announcement.node_id,
            heartbeat_interval_s=state.registry.heartbeat_interval_s,
            url=url,
            node_secret=record.secret,
            certificate=_certificate(state, record),
            tracker_key=state.signer.public().text if state.signer is not None else None,
        )

    @router.post("/v1/nodes/heartbeat")
    async def heartbeat(request: Request) -> HeartbeatResponse:
        # 16 route times of 16 hops each fit (docs/adr/0032)
        beat = await parse_model(request, Heartbeat, limit=128 * 1024)
        state = _state(request)
        if state.registry.get(beat.node_id) is not None:
            _need_node(request, beat.node_id, "a heartbeat")
        known = state.registry.heartbeat(beat)
        await state.sync()  # its lease in the shared store lives on
        directives = await state.directives_for(beat.node_id) if known else ()
        probe = state.probe_targets(beat.node_id) if known else ()
        record = state.registry.get(beat.node_id) if known else None
        return HeartbeatResponse(
            known=known, directives=directives, probe=probe,
            quarantined=record.quarantined if record is not None else None,
            certificate=_certificate(state, record),
            revoked=state.registry.revocations.keys(),
        )  # fmt: skip

    @router.post("/v1/nodes/{node_id}/verdicts")
    async def verdict(node_id: str, request: Request) -> VerdictResponse:
        """A head's audit found ``node_id`` computing wrong (docs/adr/0026); the reporter
        proves its id, and counts once (docs/adr/0032)."""
        state = _state(request)
        found = await parse_model(request, Verdict, limit=1 << 20)
        _need_node(request, found.reporter, "a verdict")
        if found.reporter == node_id:
            raise InvalidRequest("a node reports no verdict against itself", param="reporter")
        suspect = state.registry.get(node_id)
        if suspect is None:
            raise NotFound(f"unknown node {node_id!r}")
        tolerance = Precision(suspect.announcement.quantization.value).verify_tolerance
        why = check_evidence(
            found.evidence, node_id, state.registry.signer, tolerance,
            now=state.registry.clock(), witness_age_s=state.settings.witness_age_s,
        )  # fmt: skip
        if why is not None:  # counts for nothing (docs/adr/0032)
            raise InvalidRequest(
                f"verdict against {node_id!r} refused: {why}", param="evidence",
                code="bad_evidence",
            )  # fmt: skip
        strikes, quarantined = state.registry.strike(
            node_id, found, quarantine_after=state.settings.quarantine_after
        )
        await state.sync()
        return VerdictResponse(strikes=strikes, quarantined=quarantined)

    @router.delete("/v1/nodes/{node_id}/quarantine")
    async def lift(node_id: str, request: Request):
        """Let a quarantined node serve again (it was repaired): the operator's call."""
        _need_operator(request, "lifting a quarantine")
        if not _state(request).registry.lift(node_id):
            raise NotFound(f"node {node_id!r} is not quarantined")
        await _state(request).sync()
        return {"lifted": node_id}

    @router.post("/v1/nodes/assign", response_model=AssignResponse)
    async def assign(request: Request) -> AssignResponse | Response:
        state = _state(request)
        ask = await parse_model(request, AssignRequest, limit=64 * 1024)
        if not state.leads:  # placement is the leader's alone (issue 53)
            return await _ask_leader(state, request, ask)
        await state.rescan()  # a model copied in since the last scan gets this node
        placement = state.balancer.assign(ask)
        costs = state.costs[placement.model_id]
        return AssignResponse(
            shard=ShardSpec(
                model_id=placement.model_id,
                shard_start=placement.layers.start,
                shard_end=placement.layers.end,
            ),
            num_layers=costs.num_layers,
            reason=placement.reason,
            sources=_sources(state, placement.model_id, placement.layers, _own_url(request)),
            memory_bytes=_need(costs, placement, ask),
            quantization=placement.precision,
            dtype=None
            if placement.precision is None
            else compute_dtype_name(placement.precision, ask.dtype, gguf=costs.gguf),
        )

    @router.delete("/v1/nodes/{node_id}")
    async def leave(node_id: str, request: Request):
        """A node leaves (its own secret), or the operator removes one."""
        state = _state(request)
        record = state.registry.get(node_id)
        if record is None:
            raise NotFound(f"unknown node {node_id!r}")
        if record.local:
            _need_operator(request, "removing the tracker node")
        elif not state.registry.authentic(node_id, _proof(request)):
            _need_operator(request, f"removing node {node_id!r} (not its own leave)")
        if not state.registry.remove(node_id):
            raise NotFound(f"unknown node {node_id!r}")
        state.plan_moves()
        await state.sync()
        return {"removed": node_id}

    @router.get("/v1/route")
    async def route(
        model: str, request: Request, head: str | None = None, exclude: str = ""
    ) -> RouteResponse:
        avoid = frozenset(u for u in exclude.split(",") if u)
        state = _state(request)
        hops = state.route(model, head=head, exclude_urls=avoid)
        own = _own_url(request)
        return RouteResponse(
            model_id=model,
            hops=tuple(
                RouteHop(
                    node_id=h.node.node_id,
                    # The tracker node is reached where the asking head reached the tracker.
                    url=state.hop_url(h, own),
                    shard_start=h.start_layer,
                    shard_end=h.node.layers.end,
                )
                for h in hops
            ),
        )

    return router


async def _ask_leader(state: TrackerState, request: Request, ask: AssignRequest) -> Response:
    """An assignment asked of a follower, answered by the leader's placement (the ask as
    parsed here, with the caller's credentials)."""
    holder = await state.election.leader()
    if holder is None:
        raise NoLeader(
            "no tracker leads the swarm right now (one is elected within "
            f"{state.election.ttl_s:.0f}s); ask again", code="no_leader",
        )  # fmt: skip
    url = holder.partition("#")[0].rstrip("/") + "/v1/nodes/assign"
    drop = {"host", "content-length", "content-type", "content-encoding", "connection",
            "transfer-encoding"}  # fmt: skip
    headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
    headers["content-type"] = "application/json"
    try:
        answer = await state.client.post(url, content=ask.model_dump_json(), headers=headers)
    except httpx.HTTPError as exc:
        raise NoLeader(
            f"the leader tracker at {url} did not answer ({type(exc).__name__}); ask again",
            code="no_leader",
        ) from exc
    kept = {k: v for k, v in answer.headers.items() if k.lower() == "content-type"}
    return Response(answer.content, status_code=answer.status_code, headers=kept)


def _certificate(state: TrackerState, record: NodeRecord | None) -> str | None:
    """A certificate of its key for a called-back record; none for a joining one, which
    signs nothing that counts, calls to peers included (docs/adr/0032)."""
    if record is None or not record.called_back:
        return None
    return state.certify(record.node_id, record.announcement.public_key)


def _check_layers(state: TrackerState, announcement: NodeAnnouncement) -> None:
    """A model's layer count is the models dir's or the first called-back node's: a node
    announcing another is refused, never adopted (docs/adr/0032)."""
    known = state.registry.num_layers(announcement.shard.model_id)
    if known is not None and known != announcement.num_layers:
        raise InvalidRequest(
            f"{announcement.shard.model_id} has {known} layers, not {announcement.num_layers}",
            param="num_layers",
        )


def _need(costs: ModelCosts, placement: Placement, ask: AssignRequest) -> int:
    """What the assigned range needs on the node (weights at its resolved precision, KV
    budget, margin)."""
    need = NodeRequest(
        ask.memory_bytes, ask.quantization, ask.kv_tokens,
        dtype=ask.dtype, group_size=ask.quant_group_size,
    ).shard_bytes(costs, placement.layers)  # fmt: skip
    return need or 0


def _own_url(request: Request) -> str:
    """The tracker's own URL for this caller: --advertise-url, else the address it dialed."""
    settings = _state(request).settings
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    return server_url(request.scope)  # not the Host header (docs/adr/0032)


def _sources(state: TrackerState, model_id: str, layers, own_url: str) -> tuple[str, ...]:
    """Where a joining node can get its weights: peers serving exactly that range, then peers
    whose range contains it (they serve the subset), then the tracker itself."""
    exact, containing = [], []
    for record in state.registry.records():
        shard = record.announcement.shard
        if record.local or shard.model_id != model_id or record.state != NodeState.SERVING:
            continue
        if shard.layers == layers:
            exact.append(record.announcement.url)
        elif shard.shard_start <= layers.start and layers.end <= shard.shard_end:
            containing.append(record.announcement.url)
    own = (own_url,) if state.settings.models_dir is not None else ()
    return (*sorted(exact), *sorted(containing), *own)
