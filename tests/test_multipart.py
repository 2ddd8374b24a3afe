"""/predict's multipart parser: what real clients send comes back byte for byte, and every way a body
can be malformed is a BadInput saying what is wrong (the fuzz test sends generated ones to a server)."""

from __future__ import annotations

import httpx
import pytest

from optiserve.serve.multipart import MAX_PARTS, boundary_of, parse_form, upload_and_variant
from optiserve.serve.preprocess import BadInput

PNG = bytes(range(256)) * 40 + b"\r\n--not-the-boundary\r\n"  # binary, with CRLFs and dashes inside


def _encoded(files: dict, data: dict | None = None) -> tuple[bytes, str]:
    """The body and Content-Type an unmodified httpx client sends for this form."""
    request = httpx.Request("POST", "http://x/predict", files=files, data=data)
    return request.read(), request.headers["content-type"]


def test_what_a_real_client_sends_is_read_back_exactly():
    body, ctype = _encoded({"file": ("digit 7; final.png", PNG, "image/png")}, {"variant": "onnx-int8"})
    upload, variant = upload_and_variant(parse_form(body, boundary_of(ctype)))
    assert upload.name == "file" and upload.data == PNG and upload.filename == "digit 7; final.png"
    assert variant.data == b"onnx-int8" and variant.filename is None


@pytest.mark.parametrize("field", ["file", "image", "upload"])
def test_the_one_file_part_is_the_image_whatever_its_field_is_named(field):
    body, ctype = _encoded({field: ("cat.png", PNG, "image/png")})
    upload, variant = upload_and_variant(parse_form(body, boundary_of(ctype)))
    assert upload.name == field and upload.data == PNG and variant is None


def test_no_file_or_several_files_are_refused_naming_what_came():
    body, ctype = _encoded({"a": ("a.png", PNG, "image/png"), "b": ("b.png", PNG, "image/png")})
    with pytest.raises(BadInput, match="exactly one image as a file part .*this one has 2 \\(fields 'a', 'b'\\)"):
        upload_and_variant(parse_form(body, boundary_of(ctype)))
    text_only = (b'--B\r\nContent-Disposition: form-data; name="variant"\r\n\r\nfp32\r\n'
                 b'--B\r\nContent-Disposition: form-data; name="note"\r\n\r\nx\r\n--B--\r\n')
    with pytest.raises(BadInput, match="this one has none"):
        upload_and_variant(parse_form(text_only, b"B"))


def test_the_load_generators_uploads_read_back_the_same_here_and_in_python_multipart():
    """bench's multipart body, read by the server's parser and by python-multipart's (Starlette's)."""
    import asyncio

    from starlette.datastructures import Headers
    from starlette.formparsers import MultiPartParser

    from optiserve.bench.senders import multipart_file

    body, headers = multipart_file(PNG, "image.png")
    parsed = parse_form(body, boundary_of(headers["Content-Type"]))
    assert [(p.name, p.data, p.filename) for p in parsed] == [("file", PNG, "image.png")]

    async def theirs():
        async def stream():
            yield body
        form = await MultiPartParser(Headers({"content-type": headers["Content-Type"]}), stream()).parse()
        return form["file"].filename, await form["file"].read()

    assert asyncio.run(theirs()) == ("image.png", PNG)


@pytest.mark.parametrize("body, message", [
    (b"no boundary anywhere", "never occurs"),
    (b"--B\r\nContent-Disposition: form-data; name=\"file\"", "headers do not end"),
    (b"--B\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\nunterminated", "not closed by the boundary"),
    (b"--B\r\nContent-Type: image/png\r\n\r\nx\r\n--B--", "Content-Disposition: form-data; name="),
    (b"--B\r\nContent-Disposition: attachment; name=\"file\"\r\n\r\nx\r\n--B--", "Content-Disposition: form-data"),
    ((b"--B\r\nContent-Disposition: form-data; name=\"f\"\r\n\r\nx\r\n") * (MAX_PARTS + 1) + b"--B--", "at most"),
])
def test_malformed_bodies_are_bad_input_naming_the_problem(body, message):
    with pytest.raises(BadInput, match=message):
        parse_form(body, b"B")


def test_a_content_type_without_a_usable_boundary_is_refused():
    with pytest.raises(BadInput, match="needs a boundary"):
        boundary_of("multipart/form-data")
    with pytest.raises(BadInput, match="over 200"):
        boundary_of("multipart/form-data; boundary=" + "x" * 201)
    assert boundary_of('multipart/form-data; boundary="a b"') == b"a b"
