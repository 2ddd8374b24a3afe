"""Weights: checkpoints from `train` (loaded safely), ImageNet from the hub cache, random."""

import pytest
import torch

from conftest import cache_imagenet_weights, checkpoint_test_top1
from optiserve.checkpoint import read_checkpoint
from optiserve.errors import UserError
from optiserve.models import create_model, get_model_entry, load_model


def test_a_training_checkpoint_is_a_plain_dict_with_the_documented_fields(small_cnn_checkpoint):
    ckpt = torch.load(small_cnn_checkpoint, weights_only=True)
    assert ckpt["model"] == "small_cnn" and ckpt["dataset"] == "digits"
    assert ckpt["classes"] == [str(i) for i in range(10)]
    assert ckpt["input"]["shape"] == [1, 16, 16] and len(ckpt["input"]["mean"]) == 1
    assert 0.0 <= ckpt["metrics"]["val_top1"] <= 1.0 and 0.0 <= ckpt["metrics"]["test_top1"] <= 1.0
    assert ckpt["complete"] and ckpt["epoch"] == 4


def test_checkpoint_weights_rebuild_the_trained_model(small_cnn_checkpoint):
    loaded = load_model("small_cnn", str(small_cnn_checkpoint))
    top1 = checkpoint_test_top1(small_cnn_checkpoint)
    assert top1 == pytest.approx(read_checkpoint(small_cnn_checkpoint)["metrics"]["test_top1"], abs=1e-6)
    assert loaded.source["sha256"] and loaded.accuracy_meaningful and not loaded.model.training


def test_a_checkpoint_for_another_architecture_is_refused_readably(small_cnn_checkpoint, tmp_path):
    ckpt = read_checkpoint(small_cnn_checkpoint)
    ckpt["model"] = "resnet18"
    wrong = tmp_path / "wrong.pt"
    torch.save(ckpt, wrong)
    with pytest.raises(UserError, match="does not fit the architecture: .*missing"):
        load_model("resnet18", str(wrong))
    with pytest.raises(UserError, match="holds a 'resnet18' model, not 'small_cnn'"):
        load_model("small_cnn", str(wrong))


class Payload:
    def __reduce__(self):
        return (print, ("unpickled!",))


def test_untrusted_pickles_are_never_executed(tmp_path, capsys):
    evil = tmp_path / "evil.pt"
    torch.save({"model": "small_cnn", "payload": Payload()}, evil)
    with pytest.raises(UserError, match="cannot read checkpoint"):
        load_model("small_cnn", str(evil))
    assert "unpickled!" not in capsys.readouterr().out


def test_garbage_and_missing_files_give_one_line_errors(tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="cannot read checkpoint"):
        load_model("small_cnn", str(junk))
    with pytest.raises(UserError, match="does not exist"):
        load_model("small_cnn", str(tmp_path / "missing.pt"))
    with pytest.raises(UserError, match="unknown weights 'imagenett'"):
        load_model("resnet18", "imagenett")


def test_random_weights_mark_accuracy_as_meaningless():
    loaded = load_model("resnet18", "random")
    assert not loaded.accuracy_meaningful and loaded.source == {"weights": "random", "sha256": None}


def test_imagenet_weights_load_offline_from_the_hub_cache(tmp_path, monkeypatch):
    reference = create_model("resnet18").state_dict()
    cache_imagenet_weights(tmp_path, monkeypatch, reference)
    loaded = load_model("resnet18", "imagenet")
    assert torch.equal(loaded.model.state_dict()["fc.weight"], reference["fc.weight"])
    assert len(loaded.classes) == 1000 and loaded.classes[0] == "tench"


def test_cached_imagenet_weights_that_do_not_match_their_hash_are_refused(tmp_path, monkeypatch):
    cached = cache_imagenet_weights(tmp_path, monkeypatch, create_model("resnet18").state_dict(), name_hash="f37072fd")
    with pytest.raises(UserError, match="do not match the sha256 prefix in their name \\(f37072fd\\)"):
        load_model("resnet18", "imagenet")
    assert cached.is_file()  # named, not deleted behind the user's back


def test_unreachable_imagenet_weights_name_the_alternatives(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    for var in ("https_proxy", "HTTPS_PROXY", "http_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # a closed local port: the download fails at once
    monkeypatch.delenv("no_proxy", raising=False)
    monkeypatch.delenv("NO_PROXY", raising=False)
    with pytest.raises(UserError, match="not in the torch hub cache.*--weights PATH or --weights random"):
        load_model("mobilenet_v2", "imagenet")
