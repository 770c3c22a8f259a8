"""UDP servers of the pod network (tests/support/pod_network.py), standard library only:

    pod_udp.py echo HOST PORT             a provider's UDP endpoint (HTTP/3 would be QUIC here):
                                          logs every datagram it receives, answers each
    pod_udp.py dns HOST PORT NAME=IP ...  the cluster's DNS: answers A queries for the names it
                                          is given, NXDOMAIN for every other

Each datagram received is one line on standard output, `{"datagram": N, "from": "IP:PORT"}`, which
the test counts in the process's log; what it answers is the test's business only in that the
agent sees an answer.
"""

from __future__ import annotations

import json
import socket
import struct
import sys


def question_name(query: bytes) -> tuple[str, int]:
    """The first question's name and the offset past its type and class."""
    labels, at = [], 12
    while query[at]:
        length = query[at]
        labels.append(query[at + 1:at + 1 + length].decode("ascii", "replace"))
        at += 1 + length
    return ".".join(labels), at + 5


def dns_answer(query: bytes, names: dict[str, str]) -> bytes:
    (ident,) = struct.unpack("!H", query[:2])
    name, end = question_name(query)
    address = names.get(name.lower())
    question = query[12:end]
    if address is None:
        return struct.pack("!HHHHHH", ident, 0x8183, 1, 0, 0, 0) + question
    record = struct.pack("!HHHIH", 0xC00C, 1, 1, 30, 4) + socket.inet_aton(address)
    return struct.pack("!HHHHHH", ident, 0x8180, 1, 1, 0, 0) + question + record


def main() -> None:
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    names = dict(arg.lower().split("=", 1) for arg in sys.argv[4:])
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, port))
    print(json.dumps({"listening": port}), flush=True)
    received = 0
    while True:
        data, peer = sock.recvfrom(65536)
        received += 1
        print(json.dumps({"datagram": received, "from": f"{peer[0]}:{peer[1]}"}), flush=True)
        if mode == "dns":
            try:
                sock.sendto(dns_answer(data, names), peer)
            except (IndexError, struct.error):
                continue
        else:
            sock.sendto(b"received " + str(received).encode(), peer)


if __name__ == "__main__":
    main()
