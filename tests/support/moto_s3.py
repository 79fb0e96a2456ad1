"""For the S3 self-update tests: moto's S3 server, a real HTTP S3 endpoint, as a subprocess.

IAM checks are on while a test runs (`INITIAL_NO_AUTH_ACTION_COUNT` 0, set through moto's
/moto-api/reset-auth): a request must be signed (SigV4, checked against the key's secret)
by a known access key whose policies allow the action; anything else is a 403 with S3's
error code. `provision()` starts each test from a fresh account: a private bucket holding
the version file, a reader allowed `s3:GetObject` on it, a user allowed nothing, an
admin, and a role with temporary credentials (and a web identity trust) for reading.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import botocore.session
import httpx
import pytest

from app.adapters.embedded import free_port

REGION = "eu-west-1"
BUCKET = "wm-releases"
KEY = "workload-manager/version.json"
ACCOUNT = "123456789012"  # moto's default account


@dataclass(frozen=True)
class Keys:
    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


@dataclass(frozen=True)
class S3World:
    url: str  # the endpoint
    reader: Keys  # may GetObject on the bucket
    stranger: Keys  # a known user allowed nothing
    temporary: Keys  # the reader role's temporary credentials (with a session token)
    role_arn: str  # the reader role, assumable with a web identity
    admin: Any  # a botocore S3 client with every right, to change the objects

    @property
    def version_file(self) -> str:
        return f"s3://{BUCKET}/{KEY}"

    def put(self, body: bytes, key: str = KEY) -> None:
        self.admin.put_object(Bucket=BUCKET, Key=key, Body=body)


def _policy(*statements: dict[str, Any]) -> str:
    return json.dumps({"Version": "2012-10-17", "Statement": list(statements)})


class MotoS3:
    def __init__(self, log_file: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_file.open("wb")
        self._session = botocore.session.get_session()
        # no AWS settings of the machine reach the server
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MOTO_"))}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"moto server exited: {self._process.returncode}")
            try:
                httpx.get(f"{self.url}/moto-api/data.json", timeout=1.0)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise TimeoutError("moto server did not start within 30 s") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()

    def auth_after(self, unchecked: float) -> None:
        """Check IAM on every request after the next `unchecked` ones (inf: never)."""
        response = httpx.post(f"{self.url}/moto-api/reset-auth", content=str(unchecked))
        response.raise_for_status()

    def _client(self, service: str, keys: Keys | None = None) -> Any:
        """A botocore client (any key while IAM checks are off); the clients share one
        session, which loads each service's model once."""
        keys = keys or Keys("AKIAPROVISIONING0000", "provisioning")
        return self._session.create_client(
            service, region_name=REGION, endpoint_url=self.url,
            aws_access_key_id=keys.access_key_id, aws_secret_access_key=keys.secret_access_key,
        )  # fmt: skip

    def provision(self) -> S3World:
        """A fresh account (every earlier bucket, user and key gone), then IAM checks on."""
        self.auth_after(float("inf"))
        httpx.post(f"{self.url}/moto-api/reset").raise_for_status()
        iam, sts, s3 = self._client("iam"), self._client("sts"), self._client("s3")
        s3.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION})
        read = _policy({"Effect": "Allow", "Action": "s3:GetObject",
                        "Resource": f"arn:aws:s3:::{BUCKET}/*"})  # fmt: skip

        def user(name: str, policy: str | None) -> Keys:
            iam.create_user(UserName=name)
            if policy is not None:
                iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=policy)
            key = iam.create_access_key(UserName=name)["AccessKey"]
            return Keys(key["AccessKeyId"], key["SecretAccessKey"])

        admin = user("admin", _policy({"Effect": "Allow", "Action": "*", "Resource": "*"}))
        reader = user("reader", read)
        stranger = user("stranger", None)
        trust = _policy(
            {"Effect": "Allow", "Principal": {"AWS": f"arn:aws:iam::{ACCOUNT}:root"},
             "Action": "sts:AssumeRole"},
            {"Effect": "Allow",
             "Principal": {"Federated": f"arn:aws:iam::{ACCOUNT}:oidc-provider/oidc.example"},
             "Action": "sts:AssumeRoleWithWebIdentity"},
        )  # fmt: skip
        role = iam.create_role(RoleName="manager", AssumeRolePolicyDocument=trust)["Role"]
        iam.put_role_policy(RoleName="manager", PolicyName="p", PolicyDocument=read)
        assumed = sts.assume_role(RoleArn=role["Arn"], RoleSessionName="manager")["Credentials"]
        temporary = Keys(
            assumed["AccessKeyId"], assumed["SecretAccessKey"], assumed["SessionToken"]
        )
        self.auth_after(0)
        return S3World(
            url=self.url, reader=reader, stranger=stranger, temporary=temporary,
            role_arn=role["Arn"], admin=self._client("s3", admin),
        )  # fmt: skip


@contextmanager
def moto_s3_server(workdir: Path) -> Iterator[MotoS3]:
    server = MotoS3(workdir / "moto.log")
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


AWS_VARIABLES = (
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
    "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_DEFAULT_REGION",
    "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_ARN", "AWS_ROLE_SESSION_NAME",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN", "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_STS", "AWS_ENDPOINT_URL_S3",
)  # fmt: skip


def isolated_aws_environment(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS variables, config files or instance metadata of
    this machine reach botocore's chain; the region is moto's."""
    for name in AWS_VARIABLES:
        env.delenv(name, raising=False)
    env.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    env.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    env.setenv("BOTO_CONFIG", str(tmp_path / "no-boto-config"))
    env.setenv("AWS_EC2_METADATA_DISABLED", "true")
    env.setenv("AWS_REGION", REGION)


def use_keys(env: pytest.MonkeyPatch, keys: Keys) -> None:
    """The keys as AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN)."""
    env.setenv("AWS_ACCESS_KEY_ID", keys.access_key_id)
    env.setenv("AWS_SECRET_ACCESS_KEY", keys.secret_access_key)
    if keys.session_token is not None:
        env.setenv("AWS_SESSION_TOKEN", keys.session_token)
