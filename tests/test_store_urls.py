"""Every listed object ends in a row, and a URL's secret is neither taken nor printed (issue 53, point 4).

* A ``folder:`` source in a store (moto's S3 on 127.0.0.1): an object whose key a path would read otherwise (a ``..``,
  a ``.``, an empty part, a control character) is a skipped ``bad_layout`` row with its reason, never read; the
  others are built.
* A URL with credentials of any shape (``user:password@``, ``token@``, a signed or tokened query, fragment or matrix
  parameter, a percent-encoded name) given as ``--source``, ``--model``, ``--out`` or an upload target is one
  ``error:`` line, exit 2, that never holds the secret; every URL printed goes through one redaction.
* An S3 bucket name S3 refuses, and a malformed store setting (``AWS_ENDPOINT_URL``, ``AWS_REGION``,
  ``HF_ENDPOINT``), are one ``error:`` line naming it, exit 2, before anything starts.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import boto3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from flows.cli import app
from flows.cli_options import describe
from infra.cache import ledger
from infra.config import BuildConfig
from infra.sources import open_source, store
from infra.sources.names import key_text, store_key_problem
from infra.urls import bucket_problem, redacted, secret_in
from tests.image_media import sample_images
from tests.s3_proxy import Proxy, loopback_s3

BUCKET = "lf-store-keys"
ACCESS_KEY, SECRET_KEY = "AKIDSTOREKEYSTEST", "store-keys-secret-never-written"
SECRET = "sEcReT-0123456789-never-printed"
runner = CliRunner()
#: Keys below the folder's prefix that a path would read otherwise, and the reason each row gives.
HOSTILE = {
    "../outside.png": "'..' part",
    "sub/../up.png": "'..' part",
    "./dot.png": "'.' part",
    "sub//double.png": "empty part",
    "/lead.png": "empty part",
    "ctl\x01name.png": "control character",
}


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    with loopback_s3(BUCKET, ACCESS_KEY, SECRET_KEY, tmp_path_factory.mktemp("aws")) as loopback:
        yield loopback.proxy


@pytest.fixture(scope="module")
def image_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "kl-none"
    made = runner.invoke(app, ["make-tiny-model", str(out), "--family", "image", "--vae", "kl", "--text", "none"])
    assert made.exit_code == 0, made.output
    return out


def _build(source: str, model: str, out: str, *more: str) -> list[str]:
    return ["build", "--source", source, "--model", model, "--out", out, "--height", "32", "--width", "48",
            "--frames", "1", "--device", "cpu", "--dtype", "fp32", "--decode-samples", "0", "--on-loss", "accept",
            *more]  # fmt: skip


def _errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def test_every_object_of_a_folder_in_a_store_ends_in_a_row_and_unsafe_keys_are_skipped_with_why(
    s3, image_model, tmp_path
):
    client = boto3.client("s3")
    image = sample_images()[0]
    keys = ["set/fine.png", *HOSTILE]
    for key in keys:
        stem = key.rpartition(".")[0]
        client.put_object(Bucket=BUCKET, Key=f"folder/{key}", Body=image.data)
        client.put_object(Bucket=BUCKET, Key=f"folder/{stem}.txt", Body=image.caption.encode())
    out = tmp_path / "out"
    built = runner.invoke(app, _build(f"folder:s3://{BUCKET}/folder", str(image_model), str(out)))
    assert built.exit_code == 0, built.output
    rows = {row.key: row for rows in ledger.read_all(out).values() for row in rows.values()}
    assert rows["set/fine.png"].status == "done"
    for key, why in HOSTILE.items():
        row = rows[key_text(key)]
        assert (row.status, row.reason) == ("skipped", "bad_layout"), row
        assert why in (row.detail or "") and "not read" in (row.detail or ""), row.detail
    assert len(rows) == len(keys)  # every media object listed: one row each, none dropped
    assert {p.name for p in tmp_path.iterdir()} <= {"out", "out.sanity"}  # nothing written outside OUT


@pytest.mark.parametrize("key", ["tars/../up.tar", "tars/./dot.tar", "tars//double.tar", "tars/ctl\x01.tar"])
def test_a_tar_shard_whose_key_a_path_reads_otherwise_is_refused_at_listing(s3, image_model, tmp_path, key):
    """A `vbvr:`/`wds:` shard is the unit of work: a tar below the prefix whose key has a `..`, `.`, empty part or a
    control character is refused when the source is listed (one line naming it, exit 2), as a local shard that leads
    out of its folder is: never read, never skipped in silence."""
    client = boto3.client("s3")
    client.put_object(Bucket=BUCKET, Key=key, Body=b"\0" * 1024)
    try:
        out = tmp_path / "out"
        built = runner.invoke(app, _build(f"wds:s3://{BUCKET}/tars", str(image_model), str(out)))
    finally:
        client.delete_object(Bucket=BUCKET, Key=key)
    errors = _errors(built.output)
    assert built.exit_code == 2 and len(errors) == 1 and "not read" in errors[0], built.output
    assert not out.exists()


@given(st.lists(st.sampled_from(["a", "b.png", "", ".", "..", "c\x00", "d\x1f", "e\x7f", "f\x85", "%2e%2e", "é"]),
                min_size=1, max_size=5))  # fmt: skip
@settings(max_examples=200, deadline=None, derandomize=True)
def test_a_key_is_taken_only_where_a_path_reads_it_as_it_is_and_stays_below_its_prefix(parts):
    key = "/".join(parts)
    problem = store_key_problem(key)
    unsafe = any(p in ("", ".", "..") for p in parts) or any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in key)
    assert (problem is not None) == unsafe, (key, problem)
    if problem is None:  # a path reads the key as the store does, and below the prefix
        assert posixpath.normpath(key) == key and not posixpath.isabs(key)
        assert store.join(f"s3://{BUCKET}/p", key).startswith(f"s3://{BUCKET}/p/")
    assert key_text(key).isprintable()


#: Where a URL may carry a credential: (how it is put in, the URL with {secret} in its place).
SHAPES = [
    f"s3://AKIDEXAMPLE:{{secret}}@{BUCKET}/x",
    f"s3://{{secret}}@{BUCKET}/x",
    f"s3://AKIDEXAMPLE:pa/{{secret}}@{BUCKET}/x",
    f"s3://{BUCKET}/x?X-Amz-Signature={{secret}}&X-Amz-Date=20260101T000000Z",
    f"s3://{BUCKET}/x?X-Amz-Security-Token={{secret}}",
    f"s3://{BUCKET}/x?X%2DAmz%2DCredential={{secret}}",
    f"s3://{BUCKET}/x#access_token={{secret}}",
    "https://models.example.com/m?sig={secret}",
    "https://models.example.com/m;jsessionid={secret}",
    "hf://datasets/org/name?token={secret}",
    "gs://a-bucket/x?X-Goog-Signature={secret}",
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("setting", ["source", "model", "out", "upload"])
def test_a_url_with_a_secret_is_refused_in_one_line_that_never_prints_it(tmp_path, image_model, setting, shape):
    url = shape.format(secret=SECRET)
    values = {"source": f"folder:{tmp_path}", "model": str(image_model), "out": str(tmp_path / "out")}
    if setting != "upload":
        values[setting] = f"folder:{url}" if setting == "source" else url
    extra = ["--upload", url] if setting == "upload" else []
    result = runner.invoke(app, _build(values["source"], values["model"], values["out"], *extra))
    assert result.exit_code == 2 and SECRET not in result.output, result.output
    (line,) = _errors(result.output)
    assert "credentials" in line and ("upload.to" if setting == "upload" else setting) in line, line
    assert not (tmp_path / "out").exists()


_NAMES = st.sampled_from(
    ["X-Amz-Signature", "X-Amz-Security-Token", "X-Amz-Credential", "sig", "token", "access_token", "api_key",
     "apiKey", "password", "AWSAccessKeyId", "X-Goog-Signature", "client_secret", "SharedAccessSignature", "auth"]
)  # fmt: skip
_TOKENS = st.text("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", min_size=12, max_size=40)


@given(
    scheme=st.sampled_from(["s3", "s3a", "gs", "hf", "https", "http"]),
    where=st.sampled_from(["userinfo", "token@", "?", "&", "#", ";"]),
    name=_NAMES,
    encoded=st.booleans(),
    secret=_TOKENS,
)
@settings(max_examples=150, deadline=None, derandomize=True)
def test_generated_urls_with_a_secret_are_refused_and_never_shown(scheme, where, name, encoded, secret):
    host = "a-bucket" if scheme in ("s3", "s3a", "gs") else "datasets/org/name" if scheme == "hf" else "h.example"
    name = quote(name, safe="") if encoded else name
    url = {
        "userinfo": f"{scheme}://user:{secret}@{host}/x",
        "token@": f"{scheme}://{secret}@{host}/x",
        "&": f"{scheme}://{host}/x?a=1&{name}={secret}",
    }.get(where, f"{scheme}://{host}/x{where}{name}={secret}")
    assert secret_in(url) is not None, url
    assert secret not in redacted(f"error: {url} failed; vbvr:{url}"), url
    with pytest.raises(ValidationError) as caught:
        BuildConfig(source=f"vbvr:{url}", model="/m", out="/o")
    assert secret not in describe(caught.value)


@given(name=st.from_regex(r"[A-Za-z][A-Za-z0-9_.-]{0,20}", fullmatch=True), value=_TOKENS)
@settings(max_examples=100, deadline=None, derandomize=True)
def test_every_parameter_value_of_a_printed_url_is_hidden_whatever_its_name(name, value):
    assert value not in redacted(f"a line with s3://{BUCKET}/x?{name}={value} in it")


@pytest.mark.parametrize(
    ("flag", "url", "setting"),
    [
        ("--source", "folder:s3://Bad_Bucket/x", "source"),
        ("--out", "s3://ab/out", "out"),
        ("--model", "s3://192.168.5.4/m", "model"),
        ("--upload", "s3://a..b/x", "upload.to"),
        ("--source", "folder:s3://xn--bucket/x", "source"),
    ],
)
def test_an_invalid_bucket_name_is_one_line_naming_the_setting_exit_2(tmp_path, image_model, flag, url, setting):
    values = {"--source": f"folder:{tmp_path}", "--model": str(image_model), "--out": str(tmp_path / "o")}
    if flag != "--upload":
        values[flag] = url
    extra = ["--upload", url] if flag == "--upload" else []
    result = runner.invoke(app, _build(values["--source"], values["--model"], values["--out"], *extra))
    assert result.exit_code == 2, result.output
    (line,) = _errors(result.output)
    assert setting in line and "bucket" in line, line


@given(st.text("abcdefghijklmnopqrstuvwxyzABC0123456789.-_", min_size=1, max_size=70))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_a_bucket_name_taken_here_is_one_s3_takes(s3, name):
    if bucket_problem(name) is None:
        client = boto3.client("s3")
        client.create_bucket(Bucket=name)
        client.delete_bucket(Bucket=name)


@pytest.mark.parametrize(
    ("env", "value", "source"),
    [
        ("AWS_ENDPOINT_URL", "not a url", f"folder:s3://{BUCKET}/x"),
        ("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:99999", f"folder:s3://{BUCKET}/x"),
        ("AWS_ENDPOINT_URL", f"http://user:{SECRET}@127.0.0.1:9000", f"folder:s3://{BUCKET}/x"),
        ("AWS_REGION", "us east 1", f"folder:s3://{BUCKET}/x"),
        ("HF_ENDPOINT", "ftp://hub.example", "folder:hf://datasets/org/name"),
    ],
)
def test_a_malformed_store_setting_is_one_line_naming_it_exit_2(monkeypatch, tmp_path, image_model, env, value, source):
    monkeypatch.setenv(env, value)
    result = runner.invoke(app, _build(source, str(image_model), str(tmp_path / "o")))
    assert result.exit_code == 2 and SECRET not in result.output, result.output
    (line,) = _errors(result.output)
    assert line.startswith(f"error: {env}="), line
    assert not (tmp_path / "o").exists()


def test_a_metadata_row_with_a_secret_url_is_skipped_without_printing_it(s3):
    rows = [
        {"video": f"https://user:{SECRET}@media.example/a.mp4", "caption": "x"},
        {"video": "m/./b.mp4", "caption": "y"},
    ]
    boto3.client("s3").put_object(
        Bucket=BUCKET, Key="meta/rows.jsonl", Body="".join(json.dumps(r) + "\n" for r in rows).encode()
    )
    source = open_source(f"meta:s3://{BUCKET}/meta/rows.jsonl")
    refs = [ref for shard in source.shards() for ref in source.samples(shard)]
    problems = [ref.problem for ref in refs]
    assert [p.kind.value for p in problems if p] == ["outside_source", "outside_source"], problems
    assert all(SECRET not in p.detail for p in problems if p) and "'.' part" in problems[1].detail, problems
