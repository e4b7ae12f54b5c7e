"""``meshnet-tracker``: the coverage map, routing and OpenAI entry point of a swarm."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from meshnet_common.config.cli import FlagParser, add_version_flag, fail, setup_logging
from meshnet_common.config.openmp import short_spin
from meshnet_common.config.shard import check_advertise_url, check_exposure, check_range
from meshnet_common.errors import MeshnetError
from meshnet_common.models.checkpoint import CheckpointIndex
from meshnet_common.models.models_dir import resolve_snapshot
from meshnet_common.web import tls
from meshnet_common.web.auth import check_api_key_file
from meshnet_tracker.settings import TrackerSettings

PROG = "meshnet-tracker"
logger = logging.getLogger("meshnet_tracker.cli")  # also when run as __main__


EPILOG = """examples:
  # a tracker node: the coverage map, the OpenAI endpoint and layers [0, 10) of SmolLM2
  meshnet-tracker --models-dir ./models --host 0.0.0.0 --port 8080 \\
    --model-id HuggingFaceTB/SmolLM2-135M-Instruct --shard-start 0 --shard-end 10

  # a tracker node with the model from the standard HF cache (hf download, vLLM), at a revision
  meshnet-tracker --model-id Qwen/Qwen3-8B@main --shard-start 0 --shard-end 12

  # a tracker only (nodes bring the layers; it still serves ./models to joining nodes)
  meshnet-tracker --models-dir ./models --port 8080

Open http://HOST:PORT/ for the live dashboard; GET /metrics for Prometheus.
"""


def build_parser() -> FlagParser:
    parser = FlagParser(
        prog=PROG,
        description="Track which nodes serve which layers, route requests, and (with "
        "--model-id) serve the first layers itself.",
        epilog=EPILOG,
    )
    TrackerSettings.add_flags(parser)
    add_version_flag(parser, "meshnet-tracker")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    try:
        _main(argv)
    except KeyboardInterrupt:  # Ctrl-C while loading: no traceback
        raise SystemExit(130) from None


def _main(argv: Sequence[str] | None) -> None:
    parser = build_parser()
    try:
        settings = TrackerSettings.from_args(parser.parse_args(argv))
    except ValueError as exc:  # a bad env value: one line, as a bad flag
        parser.error(str(exc))
    setup_logging(settings.log_level, settings.log_format)
    spin = short_spin(os.environ)  # before torch loads (docs/adr/0036)
    check_api_key_file(PROG, settings.api_key_file)  # one line and exit 2 when it is no use
    models_dir = settings.models_dir
    if models_dir is not None and not models_dir.is_dir():  # before the slow imports
        fail(PROG, f"--models-dir {models_dir}: no such directory", code=1)
    snapshot = None
    try:  # every argument is checked before the weights load
        check_advertise_url(settings.advertise_url)
        check_exposure(settings.host, settings.swarm_token, settings.insecure)
        if settings.model_id:
            if settings.shard_start is None or settings.shard_end is None:
                raise ValueError("--model-id needs --shard-start and --shard-end")
            if settings.shard_start != 0:
                raise ValueError(
                    "the tracker node serves the first layers: use --shard-start 0 "
                    f"(not {settings.shard_start}); start other ranges with meshnet-node"
                )
            snapshot, settings = model_snapshot(settings)
            num_layers = CheckpointIndex.load(snapshot).num_layers
            check_range(settings.shard_start, settings.shard_end, num_layers)
        elif settings.shard_start is not None or settings.shard_end is not None:
            raise ValueError("--shard-start/--shard-end need --model-id")
        elif settings.revision is not None:
            raise ValueError("--revision needs --model-id")
        tls.check(settings.tls_cert, settings.tls_key, settings.tls_ca)
        if settings.store is not None:
            from meshnet_tracker.store.spec import parse_store_url

            parse_store_url(settings.store)
    except (MeshnetError, ValueError) as exc:
        fail(PROG, str(exc), code=1)
    tls.configure(settings.tls_ca)
    from meshnet_common.web.serve import announce_port, bind, run

    try:
        sock = bind(settings.host, settings.port)  # --port 0: the kernel picks, reported below
    except OSError as exc:
        fail(PROG, str(exc), code=1)
    settings = settings.replace(port=announce_port(PROG, sock))
    from meshnet_tracker.app import create_app

    try:
        url = settings.url.rstrip("/")
        node = None
        if snapshot is not None:
            try:  # the only place the tracker imports the node package
                from meshnet_tracker.tracker_node import TrackerNode
            except ImportError as exc:
                raise ValueError(
                    f"serving layers in the tracker needs the node package ({exc.name} is "
                    "missing): pip install 'meshnet-tracker[node]'"
                ) from exc
            node = TrackerNode.build(settings, snapshot, url, spin)
        app = create_app(settings, node)
        if snapshot is not None and models_dir is None:  # the model came from the HF cache
            from meshnet_common.web.shards import ShardServer, one_model

            app.state.shards = ShardServer(
                one_model(settings.model_id, snapshot),
                max_concurrent=settings.max_concurrent_downloads, fault=settings.fault_inject,
                signer=app.state.tracker.signer,
            )  # fmt: skip
    except (MeshnetError, ValueError, OSError) as exc:
        fail(PROG, str(exc), code=1)
    extra = "" if node is None else f" (tracker node: {settings.model_id} layers {node.layers})"
    run(
        app, sock,
        f"meshnet-tracker ready: {url}{extra}; dashboard: {url}/",
        log_level="warning", ws_max_size=None if node is None else node.ws_max_size(),
        tls=tls.server_options(settings.tls_cert, settings.tls_key),
    )  # fmt: skip


def model_snapshot(settings: TrackerSettings) -> tuple[Path, TrackerSettings]:
    """The snapshot of ``--model-id`` ``ORG/NAME[@REV]``: in ``--models-dir``, else in the
    standard HF cache at ``--revision`` (default main; downloaded when missing unless
    HF_HUB_OFFLINE is set). The settings come back with the bare id and, from the HF cache,
    the revision pinned to the snapshot's commit: every later look-up (placement, the files
    served to joining nodes) is of that commit, even if the branch moves."""
    from meshnet_common.models.hub.cache import split_model_ref

    model_id, revision = split_model_ref(settings.model_id, settings.revision)
    if settings.models_dir is not None:
        if revision is not None:
            raise ValueError(
                f"--revision {revision}: a revision is picked in the HF cache, and --models-dir "
                "serves the snapshot it holds; leave out one of them"
            )
        return resolve_snapshot(settings.models_dir, model_id), settings.replace(model_id=model_id)
    from meshnet_common.models.hub.download import hub_snapshot

    snapshot = hub_snapshot(model_id, revision)
    logger.info("serving %s at revision %s from the HF cache (%s)", model_id, snapshot.name,
                snapshot)  # fmt: skip
    return snapshot, settings.replace(model_id=model_id, revision=snapshot.name)


if __name__ == "__main__":
    main()
