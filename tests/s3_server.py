"""A real moto S3 server over HTTP on 127.0.0.1, for tests of the S3 store (import the fixtures you use).

The server is a subprocess in its own process group, started once per session on a free port and stopped
by its PID; `s3_env` points the default boto3 chain at it (dummy keys, AWS_ENDPOINT_URL) for one test.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.procs import free_port, stop_group, wait_answers

ACCESS_KEY = "AKIDLATENTFORGETEST"
SECRET_KEY = "latentforge-test-secret-never-logged"
REGION = "us-east-1"


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`python -m moto.server` on a free 127.0.0.1 port; yields its endpoint URL."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("moto") / "server.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_answers(f"{url}/moto-api/", server, "moto server", timeout=30)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {log_path.read_text()[-2000:]}") from None
        yield url
    finally:
        stop_group(server, timeout=10)


@pytest.fixture
def s3_env(moto_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """The default credential chain and endpoint resolution of boto3 aimed at the moto server; yields its URL."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))  # no user profile leaks in
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return moto_server
