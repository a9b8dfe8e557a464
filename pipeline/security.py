"""Who may talk to the hub: ZeroMQ CURVE keys, the hub's ZAP handler, and socket setup for both sides.

`pipeline keys DIR` writes (zmq's certificate format, secret files 0600):
  DIR/hub.key, DIR/hub.key_secret                 the hub's key pair (generators and operators need hub.key)
  DIR/NAME.key_secret + DIR/generators/NAME.key   a generator identity (default NAME: generator)
  DIR/NAME.key_secret + DIR/operators/NAME.key    an operator identity for `pipeline status` / `set`
With `auth.keys: DIR` the hub's sockets are CURVE servers: traffic is encrypted, and a peer must prove it
holds a secret key whose public key lies in DIR/generators/ or DIR/operators/. The check is the hub's ZAP
handler (polled by the hub thread, re-reading those folders when they change, so a key added mid-run
admits a new generator); it labels each connection with a user id "ROLES:PUBLIC_KEY", which every message
then carries (`user_of`). The hub binds each generator id to the user id that registered it.
Without keys nothing is authenticated, so the hub binds loopback only unless `hub.allow_insecure`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85

from pipeline.config import Config, ConfigError

HUB = "hub"
ROLES = ("generators", "operators")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq looks for the ZAP handler of a context
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def make_keys(root: Path, generators: Sequence[str] = ("generator",),
              operators: Sequence[str] = ("operator",)) -> list[Path]:
    """Create the hub's pair (once) and the named generator and operator pairs; returns the files written."""
    root = Path(root)
    written = []
    for sub in ("", *ROLES):
        (root / sub).mkdir(parents=True, exist_ok=True, mode=0o700)
    if not (root / f"{HUB}.key_secret").exists():
        written += _pair(root, HUB)
    for role, names in (("generators", generators), ("operators", operators)):
        for name in names:
            if (root / f"{name}.key_secret").exists():
                raise ConfigError(f"pipeline keys: {root / name}.key_secret exists already; pick another name")
            public, secret = _pair(root, name)
            os.replace(public, root / role / public.name)
            written += [root / role / public.name, secret]
    return written


def _pair(root: Path, name: str) -> list[Path]:
    old = os.umask(0o077)  # the secret file is readable by its owner only
    try:
        public, secret = zmq.auth.create_certificates(str(root), name)
    finally:
        os.umask(old)
    return [Path(public), Path(secret)]


@dataclass
class ClientKeys:
    public: bytes
    secret: bytes
    server: bytes  # the hub's public key


def client_keys(keys_dir: str | None, identity: str) -> ClientKeys | None:
    """A generator's or operator's keys: its own pair DIR/IDENTITY.key_secret and the hub's DIR/hub.key."""
    if not keys_dir:
        return None
    root = Path(keys_dir)
    server, _ = _load(root / f"{HUB}.key", "auth.keys")
    public, secret = _load(root / f"{identity}.key_secret", "auth.identity")
    if not secret:
        raise ConfigError(f"auth.identity: {root / identity}.key_secret holds no secret key")
    return ClientKeys(public, secret, server)


def _load(path: Path, name: str) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise ConfigError(f"{name}: cannot read key {path} ({e}); `pipeline keys DIR` makes them") from None


def secure_client(sock: zmq.Socket, keys: ClientKeys | None) -> None:
    """Before connect: a CURVE client of the hub (no-op without keys)."""
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.server


def check_exposure(cfg: Config) -> None:
    """Refuse to bind another interface than loopback with nothing authenticated, unless told to."""
    if cfg.hub.host not in LOOPBACK and not cfg.auth.keys and not cfg.hub.allow_insecure:
        raise ConfigError(
            f"hub.host: {cfg.hub.host} would let anyone who reaches it register, send rollouts and change the run; "
            "set auth.keys (see `pipeline keys`) or, on a trusted network, hub.allow_insecure: true")


def user_of(frame: zmq.Frame) -> str:
    """The user id the ZAP handler gave the connection a message came from ("" without keys)."""
    try:
        user = frame.get("User-Id")  # a str (pyzmq types every property int | str)
    except zmq.ZMQError:
        return ""
    return user if isinstance(user, str) else ""


def has_role(user: str, role: str) -> bool:
    return role in user.split(":", 1)[0].split(",")


@dataclass
class ServerAuth:
    """The hub's keys and the ZAP handler that admits listed public keys (polled by the hub thread)."""

    root: Path
    public: bytes = b""
    secret: bytes = b""
    allowed: dict[bytes, str] = field(default_factory=dict)  # public key (z85) -> roles
    stamp: tuple = ()
    zap: zmq.Socket | None = None
    refused: int = 0

    @classmethod
    def load(cls, keys_dir: str | None) -> ServerAuth | None:
        if not keys_dir:
            return None
        auth = cls(Path(keys_dir))
        public, secret = _load(auth.root / f"{HUB}.key_secret", "auth.keys")
        if not secret:
            raise ConfigError(f"auth.keys: {auth.root / HUB}.key_secret holds no secret key")
        auth.public, auth.secret = public, secret
        auth.reload()
        return auth

    def reload(self) -> None:
        """Re-read the folders of public keys when one of them changed (a key added mid-run)."""
        stamp = tuple(_mtime(self.root / role) for role in ROLES)
        if stamp == self.stamp:
            return
        allowed: dict[bytes, str] = {}
        for role in ROLES:
            if (self.root / role).is_dir():
                for public in zmq.auth.load_certificates(str(self.root / role)):  # {z85 public key: True}
                    allowed[public] = ",".join(filter(None, [allowed.get(public), role.removesuffix("s")]))
        self.allowed, self.stamp = allowed, stamp

    def bind_zap(self, ctx: zmq.Context) -> zmq.Socket:
        self.zap = ctx.socket(zmq.REP)
        self.zap.linger = 0
        self.zap.bind(ZAP_ENDPOINT)
        return self.zap

    def secure_server(self, sock: zmq.Socket) -> None:
        """Before bind: a CURVE server whose peers the ZAP handler checks."""
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = self.secret, self.public
        sock.zap_domain = b"pipeline"

    def answer(self) -> int:
        """Answer the pending ZAP requests: 200 with user id "ROLES:KEY" for a listed key, 400 otherwise. Returns
        how many it refused."""
        assert self.zap is not None  # bound (bind_zap) before the hub polls it
        refused = self.refused
        while self.zap.poll(0):
            frames = self.zap.recv_multipart()
            version, request_id, mechanism = frames[0], frames[1], frames[5]
            user = b""
            if mechanism == b"CURVE" and len(frames) > 6:
                self.reload()
                key = zmq.utils.z85.encode(frames[6])
                roles = self.allowed.get(key)
                if roles:
                    user = f"{roles}:{key.decode()}".encode()
            if not user:
                self.refused += 1
            status = (b"200", b"OK") if user else (b"400", b"public key not listed in auth.keys")
            self.zap.send_multipart([version, request_id, *status, user, b""])
        return self.refused - refused


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0
