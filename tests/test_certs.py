from __future__ import annotations

import base64
import contextlib
import ipaddress
import ssl
import stat
from pathlib import Path

from cryptography import x509

from certs.authority import ca_bundle, generate_ca, generate_files, issue_serving, service_dns_names


def test_generated_files_chain_and_cover_the_service_names(tmp_path: Path) -> None:
    paths, bundle = generate_files(tmp_path, "copilot-webhook", "flyte", dns=["webhook.example.com"], ips=["10.0.0.7"])
    leaf = x509.load_pem_x509_certificate(paths["tls.crt"].read_bytes())
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [
        "copilot-webhook",
        "copilot-webhook.flyte",
        "copilot-webhook.flyte.svc",
        "copilot-webhook.flyte.svc.cluster.local",
        "webhook.example.com",
    ]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert base64.b64decode(bundle) == paths["ca.crt"].read_bytes()
    assert stat.S_IMODE(paths["tls.key"].stat().st_mode) == 0o600
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # The API server verifies exactly this: the leaf against the caBundle, for the service's DNS name.
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(paths["tls.crt"], paths["tls.key"])
    client = ssl.create_default_context(cadata=base64.b64decode(bundle).decode())
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(incoming, outgoing, server_hostname="copilot-webhook.flyte.svc")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(10):
        for side in (c, s):
            with contextlib.suppress(ssl.SSLWantReadError):
                side.do_handshake()
        s_in.write(outgoing.read())
        incoming.write(s_out.read())
    assert c.version() is not None, "the handshake must complete and verify"


def test_service_dns_names() -> None:
    assert service_dns_names("svc", "ns")[-1] == "svc.ns.svc.cluster.local"


def test_leaf_never_outlives_its_ca() -> None:
    ca = generate_ca(days=10)
    leaf = issue_serving(ca, ["a"], days=400)
    assert leaf.cert.not_valid_after_utc == ca.cert.not_valid_after_utc


def test_ca_bundle_is_base64_pem() -> None:
    ca = generate_ca()
    assert base64.b64decode(ca_bundle(ca)).startswith(b"-----BEGIN CERTIFICATE-----")
