"""Certificates for the TLS tests (trustme): a new CA and a certificate it signed,
written as PEM files.

- `write_cert(directory, *hosts)`: cert.pem and key.pem for `hosts` (default
  127.0.0.1); returns the CA (for a client's trust), the cert file and the key file.
- `redis_tls(directory)`: the same for 127.0.0.1 and localhost plus ca.pem, as the
  `RedisTls` an EmbeddedRedis or SentinelGroup serves with.
"""

from __future__ import annotations

from pathlib import Path

import trustme

from controlplane.redisserver import RedisTls
from tests.support.ports import HOST


def write_cert(directory: Path, *hosts: str) -> tuple[trustme.CA, Path, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert(*(hosts or (HOST,)))
    directory.mkdir(parents=True, exist_ok=True)
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    cert.cert_chain_pems[0].write_to_path(str(certfile))
    cert.private_key_pem.write_to_path(str(keyfile))
    return ca, certfile, keyfile


def redis_tls(directory: Path) -> RedisTls:
    ca, certfile, keyfile = write_cert(directory, HOST, "localhost")
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    return RedisTls(str(certfile), str(keyfile), str(directory / "ca.pem"))
