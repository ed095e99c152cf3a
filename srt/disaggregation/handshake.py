"""The control messages of a prefill-decode pair and the ZMQ sockets that carry them.

The KV bytes go through the transfer engine (``base.py``); these messages only say where:

1. the router posts the request to both workers with ``bootstrap_host``, ``bootstrap_port``
   (the prefill worker's ``--disaggregation-bootstrap-port``) and ``bootstrap_room`` (a random
   64-bit id naming the pair's transfer);
2. the decode worker allocates slots for the prompt positions its own prefix cache lacks and
   sends a :class:`Registration` to ``tcp://bootstrap_host:bootstrap_port``: its engine's
   session id, its layout fingerprint, its buffers' addresses and the destination slots;
3. the prefill worker, once it has prefilled the prompt and sampled the first token, checks the
   registration against its own request (layout, prompt length and digest) and writes the KV
   of positions ``[start, num_tokens)`` with the transfer engine, then answers an
   :class:`Outcome` (the first token, or why not) to the decode worker's ``notify`` endpoint;
4. a decode worker that gives up on a room (client gone, timeout) sends a :class:`Cancel`.

Messages are orjson objects with a ``kind``; no pickle on the wire.
"""

from __future__ import annotations

import hashlib
import logging
import socket
from dataclasses import asdict, dataclass
from typing import Any

import orjson
import zmq

logger = logging.getLogger(__name__)


@dataclass
class Registration:
    room: int
    session: str  # the decode engine's session id
    notify: str  # the decode worker's tcp:// endpoint for outcomes
    fingerprint: str  # KVLayout.fingerprint
    k_addrs: list[int]
    v_addrs: list[int]
    slots: list[int]  # destination slots of positions [start, num_tokens)
    start: int  # positions before it are in the decode worker's prefix cache
    num_tokens: int  # prompt length
    prompt_digest: str


@dataclass
class Outcome:
    room: int
    ok: bool
    first_token: int = -1
    message: str = ""


@dataclass
class Cancel:
    room: int


_KINDS = {"register": Registration, "outcome": Outcome, "cancel": Cancel}
_NAMES = {cls: name for name, cls in _KINDS.items()}


def encode(msg: Registration | Outcome | Cancel) -> bytes:
    return orjson.dumps({"kind": _NAMES[type(msg)], **asdict(msg)})


def decode(data: bytes) -> Registration | Outcome | Cancel:
    obj = orjson.loads(data)
    return _KINDS[obj.pop("kind")](**obj)


def prompt_digest(ids: list[int]) -> str:
    """Both workers tokenized the same request; a different digest means they did not agree
    (another tokenizer or chat template) and the KV would be of other tokens."""
    return hashlib.blake2b(orjson.dumps(ids), digest_size=12).hexdigest()


def registration_problem(msg: Registration, fingerprint: str, prompt_ids: list[int]) -> str | None:
    """Why the prefill worker refuses a registration for its request (None: it matches): the
    pools' layouts differ, the prompts differ, or the slots do not cover the positions."""
    if msg.fingerprint != fingerprint:
        return f"KV layouts differ: prefill {fingerprint}, decode {msg.fingerprint}"
    n = len(prompt_ids)
    if msg.num_tokens != n or msg.prompt_digest != prompt_digest(prompt_ids):
        return f"the prompts differ (prefill has {n} tokens, decode {msg.num_tokens})"
    if not 0 <= msg.start < n or len(msg.slots) != n - msg.start:
        return f"{len(msg.slots)} destination slots for positions [{msg.start}, {n})"
    return None


def reachable_host(host: str) -> str:
    """An address peers can reach for a server bound to ``host`` (a wildcard bind: this
    machine's name resolved)."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return host


class Link:
    """A PULL socket bound here (``endpoint``) and PUSH sockets to peers, one per address."""

    def __init__(self, host: str, port: int = 0) -> None:
        self.ctx = zmq.Context()
        self.recv_sock = self.ctx.socket(zmq.PULL)
        bind_host = "*" if host in ("0.0.0.0", "::", "") else host
        if port:
            self.recv_sock.bind(f"tcp://{bind_host}:{port}")
        else:
            port = self.recv_sock.bind_to_random_port(f"tcp://{bind_host}")
        self.endpoint = f"tcp://{reachable_host(host)}:{port}"
        self._peers: dict[str, zmq.Socket] = {}

    def poll(self) -> list[Any]:
        out = []
        while self.recv_sock.poll(0, zmq.POLLIN):
            try:
                out.append(decode(self.recv_sock.recv()))
            except (ValueError, KeyError, TypeError) as e:
                logger.warning("dropped a malformed disaggregation message: %s", e)
        return out

    def send(self, address: str, msg: Registration | Outcome | Cancel) -> None:
        sock = self._peers.get(address)
        if sock is None:
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self._peers[address] = sock
        try:
            sock.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("disaggregation peer %s is not taking messages", address)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def is_listening(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """Whether something accepts TCP connections at host:port (a dead prefill worker's
    bootstrap port refuses them at once)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
