"""/predict's multipart/form-data uploads, parsed in one pass over the received body.

A general form parser (Starlette's, on python-multipart) feeds the body through per-chunk
callbacks into spooled files, which costs more CPU than finding a handful of boundaries in bytes
that are already in memory; /predict needs one file part (whatever its field is named: `file`,
`image`, ...) and at most a `variant` field. Anything
that is not well-formed multipart is a BadInput (400) naming what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from python_multipart.multipart import parse_options_header

from optiserve.serve.preprocess import BadInput

MAX_PARTS = 16          # /predict reads two fields; more parts than this is not a /predict upload
MAX_BOUNDARY = 200      # RFC 2046 allows 70 characters


@dataclass
class Part:
    name: str
    filename: str | None   # None for a plain text field
    data: bytes


def boundary_of(content_type: str) -> bytes:
    """The boundary parameter of a multipart/form-data Content-Type."""
    _, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if not boundary:
        raise BadInput("a multipart/form-data request needs a boundary in its Content-Type")
    if len(boundary) > MAX_BOUNDARY:
        raise BadInput(f"the multipart boundary is over {MAX_BOUNDARY} characters")
    return boundary


def parse_form(body: bytes, boundary: bytes) -> list[Part]:
    """The parts of a multipart body, in their order."""
    delimiter = b"--" + boundary
    start = body.find(delimiter)
    if start < 0:
        raise BadInput("malformed multipart body: the boundary from the Content-Type never occurs")
    separator = b"\r\n" + delimiter
    pos = start + len(delimiter)
    parts: list[Part] = []
    for _ in range(MAX_PARTS + 1):
        if body.startswith(b"--", pos):
            return parts  # the closing delimiter
        line_end = body.find(b"\r\n", pos)
        head_end = body.find(b"\r\n\r\n", line_end) if line_end >= 0 else -1
        if head_end < 0:
            raise BadInput("malformed multipart body: a part's headers do not end")
        end = body.find(separator, head_end + 4)
        if end < 0:
            raise BadInput("malformed multipart body: a part is not closed by the boundary")
        name, filename = _disposition(body[line_end + 2:head_end])
        parts.append(Part(name, filename, body[head_end + 4:end]))
        pos = end + len(separator)
    raise BadInput(f"a /predict upload has at most {MAX_PARTS} parts")


def upload_and_variant(parts: list[Part]) -> tuple[Part, Part | None]:
    """The one file part, whatever its field's name (`curl -F image=@cat.png` as well as `-F
    file=@...`), and the last text field `variant`, if any. None or several files: a BadInput."""
    files = [p for p in parts if p.filename is not None]
    if len(files) != 1:
        found = "none" if not files else f"{len(files)} (fields {', '.join(repr(p.name) for p in files)})"
        raise BadInput(f"a multipart /predict request carries exactly one image as a file part "
                       f"(e.g. curl -F file=@cat.png); this one has {found}")
    variants = [p for p in parts if p.name == "variant" and p.filename is None]
    return files[0], variants[-1] if variants else None


def _disposition(headers: bytes) -> tuple[str, str | None]:
    for line in headers.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-disposition":
            kind, params = parse_options_header(value.strip())
            name = params.get(b"name")
            if kind != b"form-data" or name is None:
                break
            filename = params.get(b"filename")
            return name.decode("utf-8", "replace"), None if filename is None else filename.decode("utf-8", "replace")
    raise BadInput('malformed multipart body: every part needs "Content-Disposition: form-data; name=..."')
