"""Resuming an interrupted search. Each pruned candidate, once recovered (the search's long part),
is kept beside the artifact folder — its ONNX file and its settings, and a text candidate's recovered
weights (safetensors, never a pickle), so `--packed` can convert it again — under a key of
everything that made it; `optimize --resume` takes a kept one instead of pruning and recovering it
again. A text candidate's weights and settings are kept as soon as it has recovered, before its
export: a search stopped (or failed) while exporting it resumes from them and only exports again.
The folder is removed once the artifact folder is published."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from optiserve.errors import UserError
from optiserve.files import atomic_write, read_json

FORMAT = 2  # raised when what a kept candidate holds changes, so older ones are not taken
GATE = "gate_after_recovery"  # what a kept candidate's settings must hold: its gate's status and reason


def cache_folder(out: Path) -> Path:
    """Where the candidates of a search publishing to `out` are kept: a hidden folder beside it."""
    out = Path(out).resolve()
    return out.with_name(f".{out.name}.search")


class SearchCache:
    """The recovered candidates of one search: `made_of` is everything but the ratio that decides
    what a candidate is (the model and its weights, the data, the recovery, the gate)."""

    def __init__(self, out: Path, made_of: dict, resume: bool):
        self.folder, self.resume = cache_folder(out), resume
        self._made_of = {"format": FORMAT, **made_of}

    def _paths(self, ratio: float) -> tuple[Path, Path]:
        text = json.dumps({**self._made_of, "ratio": ratio}, sort_keys=True, default=str)
        key = hashlib.sha256(text.encode()).hexdigest()[:20]
        return self.folder / f"{key}.onnx", self.folder / f"{key}.json"

    def _weights_path(self, ratio: float) -> Path:
        return self._paths(ratio)[0].with_suffix(".safetensors")

    def _recovered_path(self, ratio: float) -> Path:
        return self._paths(ratio)[0].with_suffix(".recovered")

    def take(self, ratio: float, onnx_to: Path) -> dict | None:
        """With --resume, the kept candidate at `ratio`, its ONNX file copied to `onnx_to`, and its
        settings; None where there is none (or no --resume), or where its settings are not what
        `keep` wrote (edited by hand, cut short by a full disk): it is then built again."""
        settings = self._kept_settings(ratio)
        if settings is not None:
            shutil.copyfile(self._paths(ratio)[0], onnx_to)
        return settings

    def holds(self, ratio: float) -> bool:
        """Whether `take` or `recovered` finds a kept candidate at `ratio` (one that needs no recovery of its own)."""
        return self._kept_settings(ratio) is not None or self.recovered(ratio) is not None

    def recovered(self, ratio: float) -> dict | None:
        """With --resume, the settings of the candidate at `ratio` whose recovered weights were kept
        (`keep_recovered`) though its export was not; None where there are none (see `take`)."""
        if not self._weights_path(ratio).is_file():
            return None
        return self._settings_at(self._recovered_path(ratio))

    def _kept_settings(self, ratio: float) -> dict | None:
        onnx, path = self._paths(ratio)
        return self._settings_at(path) if onnx.is_file() else None

    def _settings_at(self, path: Path) -> dict | None:
        if not self.resume or not path.is_file():
            return None
        try:
            settings = read_json(path)
            gate = settings[GATE]
            if not isinstance(gate["status"], str) or not isinstance(gate["reason"], (str, type(None))):
                return None
        except (UserError, KeyError, TypeError):
            return None
        return settings

    def keep_recovered(self, ratio: float, settings: dict, module) -> None:
        """Keep `module`, the candidate at `ratio` just recovered, as its weights and settings, before
        it is exported (each file written atomically; the settings last, as `recovered` reads them first)."""
        from safetensors.torch import save

        self._paths(ratio)[1].unlink(missing_ok=True)  # an older kept candidate's settings never meet these weights
        self._recovered_path(ratio).unlink(missing_ok=True)
        weights = {name: tensor.detach().clone().contiguous() for name, tensor in module.state_dict().items()}
        with atomic_write(self._weights_path(ratio)) as f:
            f.write(save(weights))
        self._write_settings(self._recovered_path(ratio), settings)

    def keep(self, ratio: float, onnx_from: Path, settings: dict) -> None:
        """Keep the recovered candidate at `ratio`, exported to `onnx_from` (written atomically: an
        interruption leaves it whole or absent; the settings last, as `take` reads them first). A text
        candidate's weights were kept by `keep_recovered` before."""
        onnx, path = self._paths(ratio)
        path.unlink(missing_ok=True)  # absent until whole
        with atomic_write(onnx) as f, open(onnx_from, "rb") as source:
            shutil.copyfileobj(source, f)
        self._write_settings(path, settings)
        self._recovered_path(ratio).unlink(missing_ok=True)  # whole now: taken, not exported again

    @staticmethod
    def _write_settings(path: Path, settings: dict) -> None:
        with atomic_write(path, "w") as f:
            json.dump(settings, f, default=lambda o: o.item() if hasattr(o, "item") else str(o))

    def load_weights(self, ratio: float, module) -> bool:
        """Load the kept candidate's recovered weights at `ratio` into `module` (the same network,
        made again); False where none were kept. A damaged file, or one that does not fit, raises."""
        path = self._weights_path(ratio)
        if not path.is_file():
            return False
        from safetensors.torch import load_file

        module.load_state_dict(load_file(str(path)))
        return True

    def kept(self) -> int:
        """How many candidates are kept: exported, or only recovered."""
        if not self.folder.is_dir():
            return 0
        return len({p.stem for p in [*self.folder.glob("*.json"), *self.folder.glob("*.recovered")]})


def clear_cache(out: Path) -> None:
    """Remove the kept candidates of a search that published to `out`."""
    shutil.rmtree(cache_folder(out), ignore_errors=True)
