"""Certificates for mutual TLS made here: a CA and the certificates it signs (the ``cryptography``
package; no X.509 is written by hand).

``pdserve up`` makes a throwaway CA in its log folder at each start (``throwaway``): one certificate
for all its servers, valid for a day, its CA key dropped once it has signed (nothing can be signed
with it afterwards). Tests make CAs and certificates of their own with ``make_ca`` / ``issue`` (a
second CA for an attacker, a new certificate for a rotation). In Kubernetes the operator makes a CA
and a certificate for each InferenceService with them (operator/tls_issuer.py).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .tls import SERVER_NAME, TlsFiles

VALID = datetime.timedelta(days=1)


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its private key, PEM."""

    cert: bytes
    key: bytes


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_ca(common_name: str = "pdserve throwaway CA", valid: datetime.timedelta = VALID) -> Issued:
    """A self-signed CA certificate and its key."""
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + valid)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def issue(ca: Issued, common_name: str, dns: tuple[str, ...] = (SERVER_NAME, "localhost"),
          ips: tuple[str, ...] = ("127.0.0.1",), valid: datetime.timedelta = VALID) -> Issued:
    """A certificate signed by ``ca`` for both ends of a connection (server and client auth), naming
    ``dns`` and ``ips`` (the default names are what pdserve's clients check: ``tls.SERVER_NAME``)."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert)
    ca_key = serialization.load_pem_private_key(ca.key, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError("issue() signs with a CA key made by make_ca (EC P-256)")
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    names = [x509.DNSName(d) for d in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + valid)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return Issued(cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))


def write(folder: str, name: str, issued: Issued, ca: Issued) -> TlsFiles:
    """``<name>.crt``, ``<name>.key`` (mode 0600) and ``ca.crt`` in ``folder``: the files a process is given."""
    os.makedirs(folder, exist_ok=True)
    cert, key, ca_path = (os.path.join(folder, f) for f in (f"{name}.crt", f"{name}.key", "ca.crt"))
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(issued.key)
    with open(cert, "wb") as f:
        f.write(issued.cert)
    with open(ca_path, "wb") as f:
        f.write(ca.cert)
    return TlsFiles(cert, key, ca_path)


def throwaway(folder: str) -> TlsFiles:
    """A new CA and one certificate it signed (for every server of this machine), written to
    ``folder/tls``; the CA's key is not kept."""
    ca = make_ca()
    return write(os.path.join(folder, "tls"), "pdserve", issue(ca, "pdserve up"), ca)
