"""The server as a Ray Serve deployment: each replica runs the same app `optiserve serve` runs —
its batchers, variants and metrics — and Ray's proxy spreads requests over the replicas, which
Ray starts and stops on its nodes by the requests in flight.

    serve run deploy/ray/serve_config.yaml          # the application file (edit the args in it)
    serve run optiserve.serve.ray_deployment:build serve="artifacts/resnet18-digits --max-batch-size 16"

`serve` holds `optiserve serve`'s own arguments, parsed by its parser (--host, --port, --workers and
the drain are Ray's business there and are ignored; --grpc-port is refused). Needs `pip install "optiserve[ray]"`."""

from __future__ import annotations

import argparse
import shlex

from optiserve.errors import UserError

REPLICA_HEADER = "X-Optiserve-Replica"  # on every answer: which replica took it (Ray's proxy hides it otherwise)


def deployment_options(args: dict, max_batch_size: int) -> dict:
    """Ray Serve options from the builder's args, checked: autoscaling on ongoing requests, and room
    for at least a full batch per replica (Ray queues what is over max_ongoing_requests in its
    proxy, and the batcher would never see a full batch)."""
    known = {"serve", "min_replicas", "max_replicas", "target_ongoing_requests", "max_ongoing_requests",
             "upscale_delay_s", "downscale_delay_s", "look_back_period_s", "num_cpus", "health_check_period_s"}
    unknown = sorted(set(args) - known)
    if unknown:
        raise UserError(f"unknown Ray deployment args {', '.join(unknown)}; known: {', '.join(sorted(known))}")

    def number(key: str, default, kind=float):
        try:
            return kind(args.get(key, default))
        except (TypeError, ValueError):
            raise UserError(f"the Ray deployment arg {key} must be a{'n integer' if kind is int else ' number'}, "
                            f"got {args[key]!r}") from None

    target = number("target_ongoing_requests", max_batch_size)
    max_ongoing = number("max_ongoing_requests", 2 * max_batch_size, int)
    if max_ongoing < max_batch_size:
        raise UserError(f"max_ongoing_requests {max_ongoing} is below --max-batch-size {max_batch_size}: Ray would "
                        f"hold requests back and no batch could fill; raise it to at least {max_batch_size}")
    autoscaling = {"min_replicas": number("min_replicas", 1, int), "max_replicas": number("max_replicas", 1, int),
                   "target_ongoing_requests": target,
                   "upscale_delay_s": number("upscale_delay_s", 30),
                   "downscale_delay_s": number("downscale_delay_s", 600),
                   "look_back_period_s": number("look_back_period_s", 30)}
    if not 1 <= autoscaling["min_replicas"] <= autoscaling["max_replicas"]:
        raise UserError(f"need 1 <= min_replicas <= max_replicas, got {autoscaling['min_replicas']} and "
                        f"{autoscaling['max_replicas']}")
    return {"autoscaling_config": autoscaling, "max_ongoing_requests": max_ongoing,
            "ray_actor_options": {"num_cpus": number("num_cpus", 1)},
            "health_check_period_s": number("health_check_period_s", 5)}


def _serve_args(text: str) -> argparse.Namespace:
    from optiserve.serve.command import add_arguments

    parser = argparse.ArgumentParser(prog="optiserve serve (Ray)")
    add_arguments(parser)
    try:
        return parser.parse_args(shlex.split(text))
    except SystemExit:
        raise UserError(f"the Ray deployment's serve args {text!r} are not what `optiserve serve` takes") from None


def build(args: dict):
    """Ray Serve application builder (`serve run optiserve.serve.ray_deployment:build serve="PATH ..."`)."""
    from ray import serve

    from optiserve.serve.command import config_from_args

    if "serve" not in args:
        raise UserError('the Ray deployment needs serve="PATH [optiserve serve options]"')
    cfg = config_from_args(_serve_args(args["serve"]))
    cfg.validate()  # a bad folder or option fails the deploy here, not in every replica
    if cfg.grpc_port is not None:
        raise UserError("--grpc-port does not apply under Ray Serve: replicas sharing a node would contend for the "
                        "port, and Ray's proxy routes HTTP only; use Ray Serve's own gRPC proxy, or serve gRPC "
                        "with `optiserve serve --grpc-port` replicas behind a load balancer (KServe, Kubernetes)")
    if cfg.tls:
        raise UserError("--tls-cert-file does not apply under Ray Serve: its HTTP proxy, not the replicas, "
                        "accepts the connections; set TLS on Ray Serve's proxy (http_options) or on the ingress")
    options = deployment_options(args, cfg.max_batch_size)

    @serve.deployment(name="optiserve", **options)
    @serve.ingress()
    class OptiserveReplica:
        """One copy of the server. Ray routes to it once its start-up is over, which here means its
        models are loaded and warm; `check_health` keeps reporting readiness afterwards."""

        def __init__(self, config):
            self.cfg = config
            import ray

            self.replica = f"{serve.get_replica_context().replica_tag}@{ray.util.get_node_ip_address()}"

        def __serve_build_asgi_app__(self):
            from optiserve.serve.app import configure_logging, create_app
            from optiserve.serve.middleware import ResponseHeader
            from optiserve.serve.tracing import configure_tracing

            configure_logging(self.cfg.log_format, self.cfg.log_level)
            configure_tracing(self.cfg.otlp_endpoint)
            self.optiserve_app = create_app(self.cfg, load_before_start=True)
            self.optiserve_app.add_middleware(ResponseHeader, name=REPLICA_HEADER, value=self.replica)
            return self.optiserve_app

        def check_health(self):
            server = self.optiserve_app.state.server
            if not server.reports_ready:
                raise RuntimeError(f"optiserve replica not ready: {server.not_ready_reason()}")

    return OptiserveReplica.bind(cfg)
