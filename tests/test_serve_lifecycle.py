"""The server's lifecycle under production conditions: a repository as a Kubernetes volume looks
(entries it cannot read, a root-only lost+found, a non-root uid), a server that only reads (read-only
folders, half-published models left to `optiserve repair`), manifests that stay inside their folder,
strict readiness, and traffic settings that survive reloads."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

import nonroot
from conftest import ROOT, crash_between_publish_renames, free_port, run_cli, until
from optiserve.artifacts import read_manifest, scan_models, staging_folder, write_manifest
from optiserve.errors import UserError
from optiserve.runtime import RuntimeOptions
from optiserve.runtime.variants import load_verified
from optiserve.serve.app import ServeConfig, create_app
from optiserve.serve.launch import wait_until_ready
from optiserve.serve.model import ServedModel
from optiserve.serve.server import Server

ZEROS = np.zeros((1, 1, 16, 16)).tolist()
TOKEN = "lifecycle-admin-token-0123456789"


def _with_variants(source: Path, target: Path, names: list[str]) -> Path:
    """A copy of the artifact folder `source` whose manifest keeps only the variants `names`."""
    shutil.copytree(source, target)
    manifest = read_manifest(target)
    manifest["variants"] = [v for v in manifest["variants"] if v["name"] in names]
    write_manifest(target, manifest)
    return target


@pytest.fixture
def repo(small_artifact, tmp_path) -> Path:
    """A repository holding one model, `digits` (the small_cnn artifact)."""
    shutil.copytree(small_artifact, tmp_path / "repo" / "digits")
    return tmp_path / "repo"


@pytest.fixture
def token_file(tmp_path) -> str:
    path = tmp_path / "token.txt"
    path.write_text(TOKEN)
    return str(path)


def _admin() -> dict:
    return {"Authorization": f"Bearer {TOKEN}"}


# ---- what a repository holds ---------------------------------------------------------------------------
def test_entries_that_are_no_model_are_skipped_with_a_reason_and_never_stop_the_scan(small_artifact, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copytree(small_artifact, repo / "digits")
    (repo / "gone").symlink_to(tmp_path / "no-such-model")              # a broken symbolic link
    (repo / "notes.txt").write_text("a file where a folder is expected")
    os.mkdir(os.fsencode(repo) + b"/caf\xe9")                          # a name that is not UTF-8
    (repo / "bad-manifest" / "manifest.json").mkdir(parents=True)       # manifest.json that is a folder
    (repo / "empty").mkdir()                                            # an ordinary folder: not worth a word
    scan = scan_models(repo)
    assert list(scan.models) == ["digits"]
    skipped = {s.name: s for s in scan.skipped}
    assert "does not exist" in skipped["gone"].reason and skipped["gone"].looks_like_model
    assert skipped["notes.txt"].reason == "a file, not a folder" and not skipped["notes.txt"].looks_like_model
    assert "not UTF-8" in skipped["caf\ufffd"].reason
    assert "not a file" in skipped["bad-manifest"].reason and skipped["bad-manifest"].looks_like_model
    assert "empty" not in skipped

    token = tmp_path / "token"
    token.write_text(TOKEN)
    cfg = ServeConfig(str(repo), variants=["onnx-int8"], admin_token_file=str(token))
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        assert c.post("/predict?model=digits", json={"inputs": ZEROS}).status_code == 200
        index = {e["name"]: e for e in c.post("/v2/repository/index", json={}, headers=_admin()).json()}
        assert set(index) == {"digits", "gone", "bad-manifest"}  # what looks like a model is listed
        assert index["gone"]["state"] == "UNAVAILABLE" and "does not exist" in index["gone"]["reason"]


def test_a_folder_left_half_published_is_not_a_model_until_repaired_and_readers_never_repair_it(
        small_artifact, tmp_path, monkeypatch):
    out = tmp_path / "digits"
    shutil.copytree(small_artifact, out)
    before = read_manifest(out)
    with crash_between_publish_renames(monkeypatch):
        with staging_folder(out) as stage:
            (stage / "manifest.json").write_text("{}")
    listing = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(UserError, match=r"a publish was interrupted.*optiserve repair"):
        read_manifest(out)
    assert scan_models(tmp_path).models == {}
    (skipped,) = [s for s in scan_models(tmp_path).skipped if s.name == "digits"]
    assert "optiserve repair" in skipped.reason
    assert sorted(p.name for p in tmp_path.iterdir()) == listing  # reading renamed nothing

    proc = run_cli("repair", str(tmp_path))
    assert proc.returncode == 0 and f"repaired {out}" in proc.stdout
    assert read_manifest(out) == before
    assert run_cli("repair", str(out)).stdout.strip() == f"nothing to repair in {out}"


def test_a_published_folder_reads_like_any_new_folder_for_other_users(small_artifact, tmp_path):
    out = tmp_path / "published"
    old = os.umask(0o022)
    try:
        with staging_folder(out) as stage:
            shutil.copytree(small_artifact, stage, dirs_exist_ok=True)
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o755  # not mkdtemp's 0700: a pod's runAsUser must read it


def test_the_repository_is_read_off_the_event_loop_when_polled_and_indexed(repo, token_file,
                                                                          monkeypatch):
    from optiserve.serve import repository as repository_module

    on_loop = []
    real = repository_module.scan_models

    def watched(path):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return real(path)

    monkeypatch.setattr(repository_module, "scan_models", watched)
    cfg = ServeConfig(str(repo), variants=["onnx-int8"], model_control="poll", poll_seconds=0.05,
                      admin_token_file=token_file)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        until(lambda: len(on_loop) >= 5)
        assert c.post("/v2/repository/index", json={}, headers=_admin()).json()[0]["state"] == "READY"
    assert on_loop and not any(on_loop)


# ---- a manifest names files inside its folder only ------------------------------------------------------
@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink", "ir-companion-link"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_at_load(small_artifact, tmp_path, escape):
    other = tmp_path / "other-model"
    shutil.copytree(small_artifact, other)
    folder = tmp_path / "mine"
    shutil.copytree(small_artifact, folder)
    manifest = read_manifest(folder)
    name = "openvino-fp32" if escape == "ir-companion-link" else "onnx-int8"
    entry = next(v for v in manifest["variants"] if v["name"] == name)
    if escape == "dotdot":
        entry["file"] = "../other-model/model.int8.onnx"
    elif escape == "absolute":
        entry["file"] = str(other / "model.int8.onnx")
    elif escape == "symlink":
        (folder / entry["file"]).unlink()
        (folder / entry["file"]).symlink_to(other / entry["file"])
    else:
        (weights,) = entry["companions"]
        (folder / weights).unlink()
        (folder / weights).symlink_to(other / weights)
    write_manifest(folder, manifest)
    with pytest.raises(UserError, match="outside the model folder"):
        load_verified(folder, entry, manifest, RuntimeOptions())
    with TestClient(create_app(ServeConfig(str(folder), variants=[name]))) as c:
        until(lambda: c.app.state.server.error is not None)
        r = c.get("/v2/health/ready")
        assert r.status_code == 503 and "outside the model folder" in r.json()["error"]


# ---- readiness -------------------------------------------------------------------------------------------
def test_explicit_mode_with_nothing_loaded_is_not_ready_until_a_model_is(repo, token_file):
    cfg = ServeConfig(str(repo), variants=["onnx-int8"], model_control="explicit", admin_token_file=token_file)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.app.state.server.started)
        r = c.get("/v2/health/ready")
        assert r.status_code == 503 and "no model is loaded" in r.json()["error"]
        assert c.post("/predict", json={"inputs": ZEROS}).status_code == 503
        assert c.post("/v2/repository/models/digits/load", headers=_admin()).status_code == 200
        assert c.get("/v2/health/ready").status_code == 200
        assert c.post("/predict", json={"inputs": ZEROS}).status_code == 200
        assert c.post("/v2/repository/models/digits/unload", headers=_admin()).status_code == 200
        assert c.get("/v2/health/ready").status_code == 503


@pytest.mark.parametrize("strict", [True, False])
def test_a_start_up_model_that_failed_holds_readiness_back_unless_readiness_is_not_strict(
        small_artifact, tmp_path, strict):
    repo = tmp_path / "repo"
    shutil.copytree(small_artifact, repo / "good")
    shutil.copytree(small_artifact, repo / "broken")
    with open(repo / "broken" / "model.int8.onnx", "ab") as f:
        f.write(b"tampered")
    cfg = ServeConfig(str(repo), variants=["onnx-int8"], strict_readiness=strict)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.app.state.server.started and c.app.state.server.repository.status["broken"].state
               != "LOADING" and "good" in c.app.state.server.models)
        r = c.get("/v2/health/ready")
        if strict:
            assert r.status_code == 503 and "'broken' did not load" in r.json()["error"]
            assert "sha256" in r.json()["error"] and "--strict-readiness false" in r.json()["error"]
        else:
            assert r.status_code == 200
        assert c.get("/v2/models/good/ready").status_code == 200  # the loaded model answers either way
        assert c.post("/predict?model=good", json={"inputs": ZEROS}).status_code == 200
        assert c.get("/v2/models/broken/ready").status_code == 503


# ---- traffic across reloads --------------------------------------------------------------------------------
def test_a_shadow_set_through_the_api_survives_a_reload_and_one_the_new_version_lacks_is_dropped_with_why(
        repo, small_artifact, token_file):
    cfg = ServeConfig(str(repo), variants=["fp32", "onnx-int8"], model_control="explicit", load_models=["digits"],
                      admin_token_file=token_file, max_batch_size=4)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.get("/v2/health/ready").status_code == 200)
        url = "/v2/models/digits/traffic"
        answering = c.get(url).json()
        assert answering["set_by"] == "fastest"
        (only,) = answering["weights"]
        r = c.put(url, json={"shadow": {"variant": only, "fraction": 1.0}}, headers=_admin())
        assert r.status_code == 400 and "already answers every request" in r.json()["error"]
        other = next(v for v in ("fp32", "onnx-int8") if v != only)
        assert c.put(url, json={"shadow": {"variant": other, "fraction": 0.5}}, headers=_admin()).status_code == 200
        assert c.post("/v2/repository/models/digits/load", headers=_admin()).status_code == 200
        after = c.get(url).json()
        assert after["shadow"] == {"variant": other, "fraction": 0.5} and after["set_by"] == "fastest"

        assert c.put(url, json={"weights": {"fp32": 1, "onnx-int8": 1}}, headers=_admin()).status_code == 200
        shutil.rmtree(repo / "digits")
        _with_variants(small_artifact, repo / "digits", ["fp32", "torchscript", "onnx-fp32"])
        cfg.variants = None  # the new version's accepted variants: no onnx-int8
        assert c.post("/v2/repository/models/digits/load", headers=_admin()).status_code == 200
        after = c.get(url).json()
        assert after["set_by"] == "fastest" and "onnx-int8" not in after["weights"]
        (entry,) = c.post("/v2/repository/index", json={}, headers=_admin()).json()
        assert entry["state"] == "READY" and "dropped the traffic weights" in entry["reason"]
        assert "no onnx-int8" in entry["reason"]


def test_a_traffic_setting_made_while_a_reload_measures_its_default_reaches_the_new_version(
        repo, monkeypatch):
    measuring, release = threading.Event(), threading.Event()
    real = ServedModel.choose_fastest

    def slow_choice(self, *args, **kwargs):
        if reloading:
            measuring.set()
            release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ServedModel, "choose_fastest", slow_choice)
    reloading = False

    async def scenario():
        nonlocal reloading
        server = Server(ServeConfig(str(repo), variants=["fp32", "onnx-int8"], model_control="explicit",
                                    load_models=["digits"], max_batch_size=4))
        await server.start()
        reloading = True
        reload = asyncio.create_task(server.repository.load_model("digits"))
        await asyncio.get_running_loop().run_in_executor(None, measuring.wait, 30)
        setting = {"weights": {"fp32": 0.25, "onnx-int8": 0.75}, "shadow": {"variant": "fp32", "fraction": 1.0}}
        server.repository.set_traffic("digits", setting)  # lands on the old version, mid-reload
        release.set()
        await reload
        traffic = server.models["digits"].traffic()
        await server.stop()
        return traffic

    traffic = asyncio.run(scenario())
    assert traffic == {"weights": {"fp32": 0.25, "onnx-int8": 0.75}, "set_by": "api",
                       "shadow": {"variant": "fp32", "fraction": 1.0}}


def test_the_index_takes_ready_as_a_boolean_and_load_locks_do_not_pile_up(repo, token_file):
    cfg = ServeConfig(str(repo), variants=["onnx-int8"], model_control="explicit", admin_token_file=token_file)
    with TestClient(create_app(cfg)) as c:
        until(lambda: c.app.state.server.started)
        r = c.post("/v2/repository/index", json={"ready": "false"}, headers=_admin())
        assert r.status_code == 400 and "true or false" in r.json()["error"]
        assert c.post("/v2/repository/index", json={"ready": True}, headers=_admin()).json() == []
        for i in range(20):
            assert c.post(f"/v2/repository/models/nope-{i}/load", headers=_admin()).status_code == 400
        assert c.post("/v2/repository/models/digits/load", headers=_admin()).status_code == 200
        assert c.app.state.server.repository._locks == {}


# ---- as Kubernetes runs it: another uid, a volume with lost+found, read-only ---------------------------------
def _volume(small_artifact: Path) -> Path:
    """A repository laid out as an ext4 volume mounted at /models looks to a pod running as uid 1000:
    two models anyone may read, and root's lost+found (mode 700; 000 when not run as root)."""
    base = Path(tempfile.mkdtemp(prefix="optiserve-volume-"))
    base.chmod(0o755)
    repo = base / "models"
    repo.mkdir()
    for name in ("digits-a", "digits-b"):
        shutil.copytree(small_artifact, repo / name)
    nonroot.world_readable(repo)
    (repo / "lost+found").mkdir(mode=0o700 if os.geteuid() == 0 else 0o000)
    (repo / "lost+found").chmod(0o700 if os.geteuid() == 0 else 0o000)
    return repo


def _serve_unprivileged(repo: Path, *args: str, extra_mounts: str = ""):
    home = nonroot.scratch_folder("optiserve-home-")
    home.chmod(0o777)
    port = free_port()
    log = tempfile.TemporaryFile("w+")
    argv = nonroot.as_unprivileged([sys.executable, "-m", "optiserve", "serve", str(repo), "--port", str(port),
                                    "--variants", "onnx-int8", "--drain-seconds", "0", *args], extra_mounts)
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                            env=nonroot.unprivileged_env(home))

    def output() -> str:
        log.seek(0)
        return log.read()

    return proc, f"http://127.0.0.1:{port}", output


@pytest.mark.skipif(nonroot.why_not() is not None, reason=f"cannot run as another uid: {nonroot.why_not()}")
def test_a_non_root_server_serves_a_volume_with_a_root_only_lost_found_and_keeps_polling(small_artifact):
    import httpx

    repo = _volume(small_artifact)
    token = repo.parent / "token"  # as a mounted Secret: readable by the pod's uid
    token.write_text(TOKEN)
    token.chmod(0o644)
    proc, base, output = _serve_unprivileged(repo, "--model-control", "poll", "--poll-seconds", "0.2",
                                             "--admin-token-file", str(token))
    try:
        wait_until_ready(base, 180, proc, output)
        for name in ("digits-a", "digits-b"):
            r = httpx.post(f"{base}/predict?model={name}", json={"inputs": ZEROS}, timeout=30)
            assert r.status_code == 200, r.text
        time.sleep(1.0)  # several polls over the unreadable entry
        index = httpx.post(f"{base}/v2/repository/index", json={}, headers=_admin(), timeout=30).json()
        assert {e["name"]: e["state"] for e in index} == {"digits-a": "READY", "digits-b": "READY"}
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(repo.parent, ignore_errors=True)
    log = output()
    assert "skipping 'lost+found': cannot be read: permission denied" in log
    assert log.count("skipping 'lost+found'") == 1  # said once, not at every poll
    assert "Traceback" not in log and "PermissionError" not in log


@pytest.mark.skipif(nonroot.why_not() is not None, reason=f"cannot run as another uid: {nonroot.why_not()}")
def test_a_server_on_a_read_only_repository_never_writes_and_a_half_published_model_waits_for_repair(
        small_artifact):
    import httpx

    repo = _volume(small_artifact)
    os.replace(repo / "digits-b", repo / ".digits-b.old-4242")  # a publish stopped between its two renames
    listing = sorted(os.listdir(repo))
    read_only = f"mount --bind {repo} {repo} && mount -o remount,bind,ro {repo}" if os.geteuid() == 0 else ""
    for folder in [repo, *[p for p in repo.iterdir() if p.name != "lost+found"]]:
        folder.chmod(0o555)
    proc, base, output = _serve_unprivileged(repo, "--model-control", "poll", "--poll-seconds", "0.2",
                                             "--strict-readiness", "true", extra_mounts=read_only)
    try:
        wait_until_ready(base, 180, proc, output)
        assert httpx.post(f"{base}/predict?model=digits-a", json={"inputs": ZEROS}, timeout=30).status_code == 200
        r = httpx.post(f"{base}/predict?model=digits-b", json={"inputs": ZEROS}, timeout=30)
        assert r.status_code == 404  # not a model yet
        assert sorted(os.listdir(repo)) == listing  # the server renamed nothing
        repo.chmod(0o755)
        proc_repair = run_cli("repair", str(repo))  # the writer's step (the host's view is writable)
        assert proc_repair.returncode == 0 and "repaired" in proc_repair.stdout
        until(lambda: httpx.post(f"{base}/predict?model=digits-b", json={"inputs": ZEROS},
                                  timeout=30).status_code == 200, 60, 0.3)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        for p in [repo, *repo.iterdir()]:
            if p.name != "lost+found":
                p.chmod(0o755)
        shutil.rmtree(repo.parent, ignore_errors=True)
    log = output()
    assert "skipping 'digits-b': a publish was interrupted" in log and "Traceback" not in log


# ---- shutdown while loading ----------------------------------------------------------------------------------
@pytest.fixture
def gated_loads(monkeypatch):
    """Every variant load waits for `release` (a load that is slow, as a large model's is)."""
    from optiserve.serve import model as model_module

    entered, release = threading.Event(), threading.Event()
    real = model_module.load_verified

    def gated(*args, **kwargs):
        entered.set()
        release.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module, "load_verified", gated)
    yield entered, release
    release.set()


def test_shutdown_does_not_wait_for_a_load_under_way_and_a_load_finishing_after_it_is_closed(
        repo, gated_loads):
    entered, release = gated_loads

    async def scenario():
        server = Server(ServeConfig(str(repo), variants=["onnx-int8"], model_control="explicit",
                                    shutdown_timeout_s=1))
        await server.start()
        loading = asyncio.create_task(server.repository.load_model("digits"))  # e.g. the repository API
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 30)
        t0 = time.monotonic()
        server.begin_shutdown()
        await server.stop()
        stopped_in = time.monotonic() - t0
        assert server.loader.busy_thread is None or server.loader.busy_thread.daemon  # never joined at exit
        release.set()  # the load finishes after shutdown began
        with pytest.raises(Exception, match="shutting down"):
            await loading
        await asyncio.sleep(0.1)
        batchers = [t for t in asyncio.all_tasks() if t.get_name().startswith("batcher-") and not t.done()]
        return stopped_in, server.models, batchers, server.repository.status["digits"]

    stopped_in, models, batchers, status = asyncio.run(scenario())
    assert stopped_in < 1.5, f"stop waited {stopped_in:.1f} s for a load"
    assert models == {} and batchers == []  # closed, not leaked
    assert status.state == "UNAVAILABLE" and "shutting down" in status.reason


def test_a_load_that_fails_after_its_sessions_started_closes_them(repo, monkeypatch):

    def broken_timing(self, *args, **kwargs):
        raise RuntimeError("timing failed")

    monkeypatch.setattr(ServedModel, "choose_fastest", broken_timing)

    async def scenario():
        server = Server(ServeConfig(str(repo), variants=["fp32", "onnx-int8"], model_control="explicit"))
        await server.start()
        with pytest.raises(Exception, match="timing failed"):
            await server.repository.load_model("digits")
        await asyncio.sleep(0.1)
        batchers = [t for t in asyncio.all_tasks() if t.get_name().startswith("batcher-") and not t.done()]
        await server.stop()
        return batchers, server.repository.status["digits"]

    batchers, status = asyncio.run(scenario())
    assert batchers == [] and status.state == "UNAVAILABLE" and "timing failed" in status.reason
