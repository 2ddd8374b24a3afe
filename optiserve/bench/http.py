"""Talking to a running server: `bench http` (check it, then run every requested load setting in turn,
over HTTP or gRPC)
and turning its /stats into results for `compare`."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from optiserve.artifacts import reported_facts
from optiserve.bench.loadgen import Load, generate_load, run_load, suits_uvloop
from optiserve.bench.payloads import image_tensors
from optiserve.bench.progress import ProgressLine
from optiserve.bench.results import Run, make_results
from optiserve.bench.senders import (PROTOCOLS, BinaryTensorSender, EmbeddingsSender, GrpcSender,
                                     PipelineBinarySender, PredictSender, RawImageSender, Sender, TextBinarySender,
                                     TextGrpcSender, TextPlainSender, TextPredictSender)
from optiserve.bench.texts import TextLoad, text_load
from optiserve.errors import UserError
from optiserve.input_spec import InputSpec

TEXT_SENDERS = {"predict": TextPredictSender, "predict-raw": TextPlainSender, "v2-binary": TextBinarySender}


def server_facts(base_url: str, samples: bool = False, timeout_s: float = 10.0, model: str | None = None) -> dict:
    """One served model's /stats (model, input, variants with accuracy and size): `model`, or the
    only one served; for a pipeline, its name and kind; a clear error when the URL is not an optiserve server, is not ready yet, or
    serves several models and none was named."""
    import httpx

    base = base_url.rstrip("/")
    try:
        ready = httpx.get(f"{base}/v2/health/ready", timeout=timeout_s)
        stats = httpx.get(f"{base}/stats", params={"samples": "true"} if samples else None, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise UserError(f"cannot reach {base}: {type(e).__name__}: {e} (is `optiserve serve` running there?)") from None
    if stats.status_code != 200:
        raise UserError(f"{base}/stats answered {stats.status_code}: is this an optiserve server?")
    try:
        facts = stats.json()
    except ValueError:
        raise UserError(f"{base}/stats did not answer JSON: is this an optiserve server?") from None
    if ready.status_code != 200:
        raise UserError(f"{base} is not ready yet (variants still loading or failed); "
                        f"wait for /v2/health/ready to answer 200")
    models = facts.get("models") or {}
    if model is None and len(models) == 1:
        model = next(iter(models))
    if model is not None and model in (facts.get("pipelines") or {}):
        return {"model": model, "kind": "pipeline", "variants": {}}  # its variants are its steps'
    if model not in models:
        names = [*models, *(f"{p} (a pipeline)" for p in facts.get("pipelines") or {})]
        raise UserError(f"{base} serves {', '.join(models) or 'no model'}: name one with --model"
                        if model is None else f"{base} does not serve a model {model!r} (it serves "
                                              f"{', '.join(names) or 'none'})")
    return models[model]


def make_sender(protocol: str, base_url: str, images: list[bytes], facts: dict, variant: str | None,
                grpc_target: str | None = None, texts: TextLoad | None = None) -> Sender:
    """The sender for `protocol` (predict, predict-raw, v2-binary, grpc or, for texts, openai) to one
    model of the server `facts` describe: `texts` where given, else `images`."""
    model = facts.get("model")
    if texts is not None:
        if protocol == "grpc":
            return TextGrpcSender(grpc_target or default_grpc_target(base_url), texts, model, variant)
        if protocol == "openai":
            return EmbeddingsSender(base_url, texts, model)
        return TEXT_SENDERS[protocol](base_url, texts, model, variant)
    if protocol == "openai":
        raise UserError("--protocol openai sends texts to /v1/embeddings; an image model takes predict, predict-raw, "
                        "v2-binary or grpc")
    if protocol == "predict":
        return PredictSender(base_url, images, model, variant)
    if protocol == "predict-raw":
        return RawImageSender(base_url, images, model, variant)
    if facts.get("kind") == "pipeline" and protocol == "v2-binary":
        return PipelineBinarySender(base_url, images, model)
    if facts.get("kind") == "pipeline" and protocol == "grpc":
        return GrpcSender.to_pipeline(grpc_target or default_grpc_target(base_url), images, model)
    tensors = image_tensors(images, InputSpec.from_dict(facts["input"]))
    if protocol == "v2-binary":
        return BinaryTensorSender(base_url, tensors, model, variant)
    if protocol == "grpc":
        return GrpcSender(grpc_target or default_grpc_target(base_url), tensors, model, variant)
    raise UserError(f"unknown protocol {protocol!r}; choose one of: {', '.join(PROTOCOLS)}")


def default_grpc_target(base_url: str) -> str:
    """The server's host at Triton's gRPC port, 8001."""
    host = urlsplit(base_url).hostname or "127.0.0.1"
    return f"[{host}]:8001" if ":" in host else f"{host}:8001"


def bench_http(base_url: str, images: list[bytes], variants: list[str] | None, concurrency: list[int],
               rates: list[float], duration_s: float, warmup_s: float, timeout_s: float = 60.0,
               progress: bool = True, settings: dict | None = None, model: str | None = None,
               protocol: str = "predict", grpc_target: str | None = None, texts: str | None = None,
               texts_per_request: int = 1, tokenizer: str | None = None) -> dict:
    """One closed-loop run per (variant, concurrency) and one open-loop run per (variant, rate),
    over `protocol`: /predict image uploads, or the images' tensors over the Open Inference
    Protocol (HTTP binary tensors, or gRPC at `grpc_target`); facts and readiness come from `base_url`.
    A text model is sent `texts` (text:FILE, `texts_per_request` a request) instead, its tokens
    counted with the tokenizer.json in the folder `tokenizer` where one is given.

    Without `variants`, requests name no variant and the server's A/B split routes them; the
    records say which variant served each one."""
    if grpc_target and protocol != "grpc":
        raise UserError("--grpc-target applies only with --protocol grpc")
    if texts is None and (texts_per_request != 1 or tokenizer):
        raise UserError("--texts-per-request and --tokenizer go with --texts text:FILE (a text model's load)")
    facts = server_facts(base_url, model=model)
    model = facts.get("model")
    text_payloads = texts_for(facts, texts, texts_per_request, tokenizer, protocol, variants)
    served = list(facts.get("variants", {}))
    for name in variants or []:
        if name not in served:
            raise UserError(f"the server does not serve variant {name!r}; it serves: {', '.join(served)}")
    if any(c < 1 for c in concurrency) or any(r <= 0 for r in rates):
        raise UserError("--concurrency takes positive integers and --rate positive numbers")
    if duration_s <= 0 or warmup_s < 0:
        raise UserError("--duration must be positive and --warmup not negative")
    loads = [Load("closed", c, duration_s, warmup_s, v, timeout_s, model=model)
             for v in (variants or [None]) for c in concurrency]
    loads += [Load("open", r, duration_s, warmup_s, v, timeout_s, model=model)
              for v in (variants or [None]) for r in rates]
    line = ProgressLine(progress)
    if protocol == "grpc":
        check_grpc(grpc_target or default_grpc_target(base_url), timeout_s=10)
    runs = [run_load(generate_load(base_url, images, load, line,
                                   make_sender(protocol, base_url, images, facts, load.variant, grpc_target,
                                               text_payloads)),
                     suits_uvloop(load.mode, protocol))
            for load in loads]
    settings = {"url": base_url, "protocol": protocol, **(text_payloads.settings() if text_payloads else {}),
                **({"grpc_target": grpc_target or default_grpc_target(base_url)} if protocol == "grpc" else {}),
                "variants": variants, "concurrency": concurrency, "rates": rates,
                "duration_s": duration_s, "warmup_s": warmup_s, "timeout_s": timeout_s, "ab": facts.get("ab"),
                **(settings or {})}
    return make_results("http", runs, settings, **_model_and_variants(facts))


def texts_for(facts: dict, texts: str | None, per_request: int, tokenizer: str | None, protocol: str,
              variants: list[str] | None) -> TextLoad | None:
    """The text load for the model `facts` describe, or None for an image model (a pipeline takes
    images too); one line where what is sent is not what the model takes."""
    name = facts.get("model")
    takes_texts = (facts.get("input") or {}).get("kind") == "text"
    if not takes_texts:
        if texts is not None:
            raise UserError(f"{name} takes images, not texts: leave out --texts (give --images DIR, or none for "
                            f"the built-in digits)")
        return None
    if texts is None:
        raise UserError(f"{name} is a text model: give --texts text:FILE (a .txt file, one text a line, or a "
                        f".tsv/.csv with a `text` column) for its requests")
    if protocol == "openai" and facts.get("task") not in (None, "text-embedding"):
        raise UserError(f"{name} is a {facts['task']} model; --protocol openai sends /v1/embeddings, which serves "
                        f"text-embedding models: measure it over --protocol predict, predict-raw, v2-binary or grpc")
    if protocol == "openai" and variants:
        raise UserError("/v1/embeddings names no variant (the server's A/B split routes it): leave out --variants, "
                        "or measure variants over --protocol predict, v2-binary or grpc")
    counter = None
    if tokenizer is not None:
        counter = Path(tokenizer) / facts["input"]["tokenizer"]
        if not counter.is_file():
            raise UserError(f"--tokenizer {tokenizer}: no {facts['input']['tokenizer']} there; give the model's "
                            f"folder (the one `optiserve serve` serves), whose tokenizer counts the tokens")
    return text_load(texts, per_request, counter, facts["input"].get("max_length"))


def check_grpc(target: str, timeout_s: float) -> None:
    """A clear error when nothing answers the Open Inference Protocol over gRPC at `target`."""
    import grpc

    from optiserve.grpc_protocol import pb, stub

    with grpc.insecure_channel(target) as channel:
        try:
            ready = stub(channel).ServerReady(pb.ServerReadyRequest(), timeout=timeout_s).ready
        except grpc.RpcError as e:
            raise UserError(f"no gRPC inference server answers at {target} ({e.code().name}: {e.details()}); "
                            f"start the server with --grpc-port, or name its port with --grpc-target HOST:PORT") from None
    if not ready:
        raise UserError(f"the gRPC server at {target} is not ready yet")


def _model_and_variants(facts: dict) -> dict:
    """The model and per-variant facts of a server's /stats, as `make_results` takes them."""
    return {"model": {"name": facts.get("model"), "input": facts.get("input")},
            "variants": {name: reported_facts(v) for name, v in facts.get("variants", {}).items()}}


def results_from_server(facts: dict, url: str) -> dict:
    """A results dict from a running server's /stats?samples=true: its real A/B traffic so far."""
    runs = []
    for name, v in facts.get("variants", {}).items():
        samples = v.get("latency_ms_samples") or []
        outcomes = v.get("outcomes", {})
        ok = outcomes.get("ok", 0)
        failed = [(k, n) for k, n in outcomes.items() if k != "ok"]
        # the server keeps a window of recent latencies; older successes are counted without one
        latency = list(samples) + [None] * max(0, ok - len(samples))
        status = ["ok"] * len(latency) + [k for k, n in failed for _ in range(n)]
        records = {"latency_ms": latency + [None] * (len(status) - len(latency)),
                   "ok": [True] * len(latency) + [False] * (len(status) - len(latency)),
                   "status": status, "variant": [name] * len(status)}
        counts = {k: int(k) * n for k, n in (v.get("batch_size_counts") or {}).items()}
        runs.append(Run("server", 0, name, float(v.get("elapsed_s") or 0.0), 1, records, counts))
    settings = {"url": url, "ab": facts.get("ab"), "shadow": _shadow(facts)}
    return make_results("server", runs, settings, **_model_and_variants(facts))


def _shadow(facts: dict) -> list[dict]:
    """Per shadow variant: images compared with the answering variant and how many agreed on top-1."""
    return [{"variant": name, "images": int(s.get("images") or 0), "agreed": int(s.get("agreed") or 0),
             "dropped": int(s.get("dropped") or 0), "latency_ms": s.get("latency_ms")}
            for name, s in (facts.get("shadow") or {}).items()]

