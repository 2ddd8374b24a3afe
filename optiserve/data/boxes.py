"""Images with true boxes: the images straight in a folder, annotated by a COCO-format JSON file
(`images`, `annotations` with `bbox` [x, y, width, height] in the image's pixels, `category_id`,
`iscrowd`), each image's boxes placed on the model's input as the image is."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from torch.utils.data import Dataset, Subset

from optiserve.data.imagefolder import EvalPreprocess, UnlabelledImages, image_files
from optiserve.data.partition import random_split
from optiserve.data.splits import DatasetSplits
from optiserve.errors import UserError, first_line
from optiserve.input_spec import InputSpec, placement


@dataclass
class Annotated:
    """One image's entry: its size as the file states it (width, height) and its boxes [T, 6] in its
    pixels: x1, y1, x2, y2, 1 (scored) or 0 (a crowd region, not scored), category id."""

    size: tuple[int, int] | None
    rows: np.ndarray


def _number(value, what: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UserError(f"--boxes {path}: {what} is {value!r}, not a number")
    return float(value)


def _is_id(value) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def read_coco_boxes(path: Path) -> dict[str, Annotated]:
    """Each image's true boxes, by the image's file name (without folders), from a COCO-format file.
    Boxes without area are left out; a crowd region (`iscrowd` 1) is kept as a region not scored."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"--boxes {path} does not exist (a COCO-format JSON file of the images' boxes)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"--boxes {path} is not a JSON file: {first_line(e)}") from None
    if not isinstance(data, dict) or not isinstance(data.get("images"), list) \
            or not isinstance(data.get("annotations"), list):
        raise UserError(f"--boxes {path} is not in COCO's format: it needs an `images` list (id, file_name, "
                        f"width, height) and an `annotations` list (image_id, bbox, category_id)")
    by_id: dict = {}
    for image in data["images"]:
        if not isinstance(image, dict) or not _is_id(image.get("id")) or not isinstance(image.get("file_name"), str):
            raise UserError(f"--boxes {path}: an entry of `images` has no id (a number or a string) or file_name: "
                            f"{str(image)[:80]}")
        size = None
        if "width" in image and "height" in image:
            size = (int(_number(image["width"], "an image's width", path)),
                    int(_number(image["height"], "an image's height", path)))
        by_id[image["id"]] = (Path(image["file_name"]).name, size, [])
    for note in data["annotations"]:
        if not isinstance(note, dict) or not _is_id(note.get("image_id")):
            raise UserError(f"--boxes {path}: an entry of `annotations` has no image_id (a number or a string): "
                            f"{str(note)[:80]}")
        if note["image_id"] not in by_id:
            continue
        bbox = note.get("bbox")
        if not isinstance(bbox, list) or len(bbox) != 4:
            raise UserError(f"--boxes {path}: annotation {note.get('id', '?')} has bbox {bbox!r}; COCO's bbox is "
                            f"[x, y, width, height] in the image's pixels")
        x, y, w, h = (_number(v, "a bbox value", path) for v in bbox)
        category = note.get("category_id")
        if isinstance(category, bool) or not isinstance(category, int) or category < 0:
            raise UserError(f"--boxes {path}: annotation {note.get('id', '?')} has category_id {category!r}, "
                            f"not a class id (an integer from 0)")
        if w > 0 and h > 0:
            by_id[note["image_id"]][2].append([x, y, x + w, y + h, 0.0 if note.get("iscrowd") else 1.0, category])
    return {name: Annotated(size, np.asarray(rows, np.float32).reshape(-1, 6)) for name, size, rows in by_id.values()}


def boxes_on_input(rows: np.ndarray, spec: InputSpec, width: int, height: int) -> np.ndarray:
    """An image's boxes in its pixels ([T, 6], width x height) -> on the model's input, placed as
    `image_to_input` places the image, clipped to the input."""
    place = placement(spec, width, height)
    out = rows.copy()
    for i, (x1, y1, x2, y2) in enumerate(rows[:, :4].tolist()):
        out[i, :2] = place.to_input(x1, y1, (width, height))
        out[i, 2:4] = place.to_input(x2, y2, (width, height))
    h, w = spec.size
    out[:, [0, 2]] = out[:, [0, 2]].clip(0, w)
    out[:, [1, 3]] = out[:, [1, 3]].clip(0, h)
    return out


class BoxedImages(Dataset):
    """Images with their true boxes: (input, boxes [T, 6] on the input)."""

    def __init__(self, files: list[Path], annotated: list[Annotated], spec: InputSpec, boxes_file: Path):
        self.images = UnlabelledImages(files, EvalPreprocess(spec))
        self.files, self.annotated, self.spec, self.boxes_file = files, annotated, spec, boxes_file

    def __len__(self) -> int:
        return len(self.files)

    def open(self, i: int) -> Image.Image:
        """Image i, decoded; its size must be the one the file states, where it states one."""
        image = self.images.open(i)
        stated = self.annotated[i].size
        if stated is not None and stated != image.size:
            raise UserError(f"--boxes {self.boxes_file} says {self.files[i].name} is {stated[0]}x{stated[1]} but it is "
                            f"{image.size[0]}x{image.size[1]}; boxes label the image's own pixels")
        return image

    def __getitem__(self, i: int):
        image = self.open(i)
        return self.images.transform(image), boxes_on_input(self.annotated[i].rows, self.spec, *image.size)


def load_boxed_splits(root: Path, boxes_file: Path, spec: InputSpec, seed: int) -> DatasetSplits:
    """The images straight in `root` that `boxes_file` annotates, split at random (deterministically);
    the rest are left out."""
    annotations = read_coco_boxes(boxes_file)
    loose = image_files(root)
    files = [f for f in loose if f.name in annotations]
    if len(files) < 10:
        raise UserError(f"{root}: {len(files)} of its images are in --boxes {boxes_file} (matched by file name); "
                        f"at least 10 are needed to split into calibration and held-out images")
    full = BoxedImages(files, [annotations[f.name] for f in files], spec, boxes_file)
    full.open(0)  # a file about other images, or at another size, is refused before any work
    tr, va, te = random_split(len(files), seed)
    return DatasetSplits(f"imagefolder:{root} with boxes {boxes_file}", Subset(full, tr), Subset(full, va),
                         Subset(full, te), [], spec, calib=Subset(full, tr), labelled=False, in_memory=False,
                         truth="boxes", left_out=len(loose) - len(files))
